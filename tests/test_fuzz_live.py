"""A fuzz run over every endpoint with the real daemon running (issue 12): whatever a tenant
sends, the answer is a 2xx or a 4xx in OpenAI's error shape, never a 5xx and never a hang,
and the daemon that serves every tenant is the same process at the end.

The live stack: daphne (``web``: tenants alpha and beta, their keys), ``run_scheduler`` with
Gemma (``daemon``), Redis. The tests run in file order and share the daemon:

1. schemathesis over the OpenAPI schema, every operation and phase (examples, coverage,
   fuzzing), against daphne with alpha's key; completion bodies are steered to the live model
   with a small ``max_tokens`` (tests/fuzz_hooks.py), so generated requests reach the model.
   Checks: ``not_a_server_error`` (no 5xx at all, 503 included) and ``openai_error_shape``.
2. Hypothesis-built hostile bodies aimed at what reaches llama.cpp: GBNF grammars (random,
   mutated, deeply nested, huge repetitions, surrogates, NUL), JSON schemas with huge counts,
   chat messages with the template's markers and surrogates, stop strings, logit_bias, token-id
   prompts, numbers at and past their ranges, deep JSON, non-UTF-8 bytes; hostile ids,
   ``Last-Event-ID`` values and dates on the GET endpoints.
3. Hostile websocket messages over a real socket: each is answered (an ``error``, or the
   request runs), the socket stays open, and a valid request afterwards completes.
4. The daemon's pid is the one recorded at the start, its process still runs, and another
   tenant's ordinary request completes with ``done``.

Every example is checked as it is answered, and the daemon's process after each: a failure
names the input. Hypothesis runs derandomized with bounded examples (reproducible, bounded);
schemathesis has a fixed seed. Client timeouts are hang guards only (``HANG_GUARD_S``):
nothing here passes or fails on speed.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import urllib.parse
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, example, given, note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from tests.live_service import ROOT, RealDaemon, WebServer
from wire import errors

pytestmark = pytest.mark.slow

HANG_GUARD_S = 180  # an answer slower than this is a hang, not a slow machine
MAX_TOKENS = 4  # generated tokens per request: the model runs, briefly
SCHEMATHESIS_MAX_EXAMPLES = 25  # per operation, fuzzing phase (coverage: every case it defines)
SEED = 12
# (a refusal of the daemon, as an error event: these are 4xx; anything else is a failure)
CLIENT_ERROR_CODES = {code for code, entry in errors.CODES.items() if entry.status < 500}
FUZZ = settings(
    derandomize=True, database=None, deadline=None, print_blob=False,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: each try is a live request
    suppress_health_check=list(HealthCheck),
)


@dataclass
class Live:
    web: WebServer
    daemon: RealDaemon
    pid: int

    @property
    def model(self) -> str:
        return self.daemon.model

    def assert_daemon_alive(self, after: str) -> None:
        code = self.daemon.proc.poll()
        assert code is None, (
            f"the daemon (pid {self.pid}) exited with {code} after {after}\n"
            f"daemon log:\n{self.daemon.log_tail(60)}\nweb log:\n{self.web.log_tail(20)}")


@pytest.fixture(scope="module")
def live(web, daemon) -> Live:
    snapshot = daemon.snapshot()
    assert snapshot.get("pid"), f"the daemon's snapshot names no pid: {snapshot}"
    assert daemon.proc.poll() is None
    return Live(web, daemon, snapshot["pid"])


# (status, error code) of every answer, per test: printed at the end of each (``-s``)
TALLY: collections.Counter[tuple[str, str, str]] = collections.Counter()


@pytest.fixture(autouse=True)
def tally(request):
    yield
    mine = {k: n for k, n in TALLY.items() if k[0] == request.node.name}
    if mine:
        lines = [f"{n:5} {status} {code}" for (_, status, code), n in sorted(mine.items())]
        print(f"\n{request.node.name}: {sum(mine.values())} answers\n" + "\n".join(lines))


def _count(status: int | str, answer: Any) -> None:
    code = ""
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        code = str(answer["error"].get("code"))
    elif isinstance(answer, list):
        code = "stream"
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[-1].split(" ")[0]
    TALLY[(test, str(status), code)] += 1


def short(value: Any, limit: int = 600) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


# -- answers ------------------------------------------------------------------------------------


def assert_error_shape(body: Any, context: str) -> None:
    error = body.get("error") if isinstance(body, dict) else None
    assert isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(
        error.get("type"), str) and "param" in error and "code" in error, (
        f"not OpenAI's error shape: {short(body)}\n{context}")


def send(live: Live, method: str, path: str, body: Any = None, key: str | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One request, its whole answer read and checked: a 2xx (SSE streams to ``[DONE]``,
    with no error event a 4xx would not describe) or a 4xx in OpenAI's error shape. Returns
    (status, JSON body or list of SSE chunks)."""
    key = live.web.keys["owner"] if key is None else key
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    context = f"request: {method} {short(path, 300)} {short(data)}"
    if currently_in_test_context():
        note(context)
    try:
        reply = live.web.request(method, path, body=data, key=key, headers=headers,
                                 timeout=HANG_GUARD_S)
        status = reply.status
        if (reply.header("Content-Type") or "").startswith("text/event-stream"):
            answer: Any = [chunk for _, chunk in reply.sse()]
            reply.conn.close()
        else:
            raw = reply.response.read()
            reply.conn.close()
            try:
                answer = json.loads(raw) if raw else None
            except ValueError:
                answer = raw
    except TimeoutError:
        raise AssertionError(f"no answer within {HANG_GUARD_S} s (hang guard)\n{context}\n"
                             f"web log:\n{live.web.log_tail(20)}") from None
    context += f"\nanswer: {status} {short(answer)}"
    _count(status, answer)
    assert status < 500, f"a server error\n{context}\nweb log:\n{live.web.log_tail(30)}\n" \
                         f"daemon log:\n{live.daemon.log_tail(30)}"
    if status >= 400 and method != "HEAD":
        assert_error_shape(answer, context)
    elif isinstance(answer, list):
        assert answer and answer[-1] == "[DONE]", f"the stream did not end with [DONE]\n{context}"
        for chunk in answer[:-1]:
            event = json.loads(chunk)
            if "error" in event:
                assert_error_shape(event, context)
                assert event["error"].get("code") in CLIENT_ERROR_CODES, (
                    f"an error event a 4xx would not describe\n{context}\n"
                    f"daemon log:\n{live.daemon.log_tail(30)}")
    live.assert_daemon_alive(context)
    return status, answer


# -- 1. schemathesis over the OpenAPI schema -----------------------------------------------------

SCHEMATHESIS_TOML = """
[checks.not_a_server_error]
expected-statuses = ["2xx", "3xx", "4xx"]
"""


def test_schemathesis_every_operation_with_the_daemon(live, tmp_path):
    """Every operation, examples + coverage + fuzzing phases, no 5xx, 4xx in OpenAI's shape."""
    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_TOML)
    calls = tmp_path / "calls.jsonl"
    env = {**live.web.env, "SCHEMATHESIS_HOOKS": "tests.fuzz_hooks", "FUZZ_MODEL": live.model,
           "FUZZ_MAX_TOKENS": str(MAX_TOKENS), "FUZZ_LOG": str(calls),
           "PYTHONPATH": str(ROOT)}
    argv = [
        str(Path(sys.executable).with_name("schemathesis")), "--config-file", str(config),
        "run", f"{live.web.base_url}/v1/openapi.json",
        "-H", f"Authorization: Bearer {live.web.keys['owner']}",
        "--checks", "not_a_server_error,openai_error_shape",
        "--phases", "examples,coverage,fuzzing", "--max-examples",
        str(SCHEMATHESIS_MAX_EXAMPLES), "--workers", "1", "--seed", str(SEED),
        "--generation-database", "none", "--request-timeout", str(HANG_GUARD_S),
        "--output-sanitize", "false",
    ]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=3600)  # a hang guard: the per-request guard fires first
    seen = collections.Counter()
    for line in calls.read_text().splitlines() if calls.exists() else []:
        call = json.loads(line)
        seen[(call["op"], call["status"], call["code"])] += 1
    summary = "\n".join(f"{n:5} {op} {status} {code or ''}"
                        for (op, status, code), n in sorted(seen.items()))
    phases = done.stdout[done.stdout.find("Examples"):done.stdout.find("=====")].strip()
    print(f"schemathesis: {sum(seen.values())} calls\n{phases}\n{summary}")
    assert done.returncode == 0, (done.stdout[-8000:] + done.stderr[-3000:]
                                  + "\nweb log:\n" + live.web.log_tail(30)
                                  + "\ndaemon log:\n" + live.daemon.log_tail(30))
    live.assert_daemon_alive("the schemathesis run")
    generated = sum(n for (op, status, _), n in seen.items()
                    if op.endswith("completions") and op.startswith("POST") and status == 200)
    assert generated, f"no generated request reached the model:\n{summary}"


# -- 2. hostile bodies --------------------------------------------------------------------------

# Text the model takes (valid Unicode: the template's markers, Jinja syntax, NUL, emoji,
# forged log lines...), and text it must refuse (lone surrogates) on top.
MARKERS = [
    "<start_of_turn>", "<end_of_turn>", "<start_of_turn>model\n", "<end_of_turn>\n<start_of_turn>"
    "system\n", "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<start_of_image>", "[@BOS@]",
    "{{", "}}", "{%", "%}", "{{ raise_exception('boom') }}", "{% for m in messages %}x{% endfor %}",
    "{{ messages[0]['content'] * 99999 }}", "\x00", "\U0001f600", "\ufeff", "\u202e", "\r\n",
    "\\", '"', "'", "\x1b[31m", '{"event": "request_end"}\n', "\u0301", "\uffff", "\U0010ffff",
]
SURROGATES = ["\ud800", "\udfff", "\ud83d", "\udc00\ud800"]
weird_text = st.lists(st.one_of(st.sampled_from(MARKERS), st.text(max_size=12)),
                      max_size=6).map("".join)
hostile_text = st.lists(st.one_of(st.sampled_from(MARKERS + SURROGATES), st.text(max_size=12)),
                        max_size=6).map("".join)

REPEATS = ["*", "+", "?", "{0}", "{1}", "{3,5}", "{5,3}", "{0,}", "{1000}", "{1001}", "{0,1000}",
           "{999,1000}", "{2000}", "{65536}", "{4294967296}", "{99999999999999999999}", "{-1}",
           "{,5}", "{}", "{1,2,3}"]
GBNF_ATOMS = [
    '"a"', '""', '"\\x00"', '"\\u0000"', '"\\ud800"', '"\\U00110000"', '"\\xZZ"', '"\\"',
    "[a-z]", "[^a]", "[]", "[^]", "[z-a]", "[\\x00-\\U0010FFFF]", "[^\\x00-\\U0010FFFF]", ".",
    "<[0]>", "<[1]>", "<[262143]>", "<[262144]>", "<[-1]>", "<[99999999999]>", "<eos>", "x", "ws",
    "undefined-rule", "root", "(", ")", "|", "::=", '"\x00"', '"\ud800"',
]
RULE_NAMES = ["root", "x", "ws", "a-b", "1bad", "", "ä", "root\x00"]


def _gbnf_expression() -> st.SearchStrategy[str]:
    atoms = st.one_of(st.sampled_from(GBNF_ATOMS),
                      hostile_text.map(lambda t: '"' + t.replace('"', '\\"') + '"'))
    return st.recursive(atoms, lambda inner: st.one_of(
        st.tuples(inner, inner).map(" ".join),
        st.tuples(inner, inner).map(" | ".join),
        inner.map(lambda e: f"({e})"),
        st.tuples(inner, st.sampled_from(REPEATS)).map("".join),
    ), max_leaves=10)


def _grammar_text(root: str, rules: list[tuple[str, str]]) -> str:
    return "\n".join([f"root ::= {root}"] + [f"{name} ::= {expr}" for name, expr in rules])


def _mutate(text: str, edits: list[tuple[float, int, str]]) -> str:
    for where, op, char in edits:
        at = int(where * len(text))
        if op == 0:
            text = text[:at] + char + text[at:]
        elif op == 1:
            text = text[:at] + text[at + 1:]
        else:
            text = text[:at] + text[at:at + 40] * 3 + text[at:]
    return text


SEED_GRAMMARS = [
    'root ::= "a"', 'root ::= [a-z]+ "."', 'root ::= x x\nx ::= "b" | "c" x',
    'root ::= ("yes" | "no") ws\nws ::= [ \\t\\n]*', 'root ::= <[1]> "a"{2,4}',
]


def _gbnf_literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\x00", "\\x00") + '"'


# Grammars llama.cpp's parser takes (defined rules, legal classes and counts): they reach the
# grammar sampler, with the model's tokens, the end of generation and ``ignore_eos``.
LEGAL_ATOMS = ['""', "[a-z]", "[^a]", "[0-9A-F]", '[^\\n"]', ".", "[\\u00e0-\\u00ff]",
               "[\\U0001F600-\\U0001F64F]", "[ \\t\\n]", "<[1]>", "<[2]>", "<[106]>", "<[107]>",
               "<[1000]>", "<[262143]>", "x", "y", '"\\n"', '"\\u00e9"', "[\\x01]"]
LEGAL_REPEATS = ["*", "+", "?", "{0}", "{1}", "{2,5}", "{0,3}", "{3}", "{1,}", "{0,20}"]


def _legal_expression() -> st.SearchStrategy[str]:
    atoms = st.one_of(st.sampled_from(LEGAL_ATOMS), weird_text.map(_gbnf_literal))
    return st.recursive(atoms, lambda inner: st.one_of(
        st.tuples(inner, inner).map(" ".join),
        st.tuples(inner, inner).map(" | ".join),
        st.tuples(inner, st.sampled_from(LEGAL_REPEATS)).map(lambda t: f"({t[0]}){t[1]}"),
    ), max_leaves=8)


legal_grammars = st.builds(lambda r, x, y: f"root ::= {r}\nx ::= {x}\ny ::= {y}",
                           _legal_expression(), _legal_expression(),
                           st.one_of(st.sampled_from(LEGAL_ATOMS[:6]),
                                     weird_text.map(_gbnf_literal)))
grammars = st.one_of(
    legal_grammars, legal_grammars,
    st.builds(_grammar_text, _gbnf_expression(),
              st.lists(st.tuples(st.sampled_from(RULE_NAMES), _gbnf_expression()), max_size=3)),
    st.builds(_mutate, st.sampled_from(SEED_GRAMMARS), st.lists(st.tuples(
        st.floats(0, 1), st.integers(0, 2),
        st.sampled_from(list('()[]{}|*+?"\\\n:=<>-^.') + ["\x00", "\ud800", "{99999}"])),
        min_size=1, max_size=4)),
    st.sampled_from([255, 256, 257, 511, 512, 513, 1000, 5000, 20000]).map(
        lambda n: "root ::= " + "(" * n + '"a"' + ")" * n),
    st.integers(1, 6).map(lambda d: "root ::= " + "(" * d + '"a"' + "){0,1000}" * d),
    st.sampled_from([
        'root ::= root "a"', 'root ::= x "a"\nx ::= y\ny ::= "" | root',
        'root ::= x\nx ::= x x | "a"', 'root ::= ' + " | ".join(f'"{i}"' for i in range(3000)),
        "root ::= " + " ".join(["x"] * 500) + '\nx ::= "a"?', 'root ::= "a"' * 2000,
        "root ::= " + '"' + "a" * 140_000 + '"',
    ]),
    hostile_text,
)


@st.composite
def request_base(draw, kind: str | None = None) -> tuple[str, dict[str, Any]]:
    """An endpoint and a valid body for it, small ``max_tokens`` (the hostile part is added)."""
    kind = kind or draw(st.sampled_from(["chat", "completion"]))
    body: dict[str, Any] = {"max_tokens": MAX_TOKENS}
    if draw(st.booleans()):
        body["stream"] = True
    if draw(st.booleans()):
        body["temperature"] = 0
    if kind == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "Hi"}]}
    return "/v1/completions", {**body, "prompt": "Once upon a time"}


def _post(live: Live, endpoint: str, body: dict[str, Any]) -> tuple[int, Any]:
    return send(live, "POST", endpoint, {"model": live.model, **body})


def test_hostile_grammars(live):
    @settings(FUZZ, max_examples=100)
    @given(request_base(), grammars, st.booleans())
    @example(("/v1/completions", {"prompt": "Hi", "max_tokens": 8}), 'root ::= "\ud800"', False)
    @example(("/v1/completions", {"prompt": "Hi", "max_tokens": 8}), 'root ::= "a"', True)
    @example(("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                       "max_tokens": 8, "stream": True}), 'root ::= "a"', True)
    @example(("/v1/completions", {"prompt": "Hi", "max_tokens": 4}),
             "root ::= " + "(" * 20000 + '"a"' + ")" * 20000, False)
    @example(("/v1/completions", {"prompt": "Hi", "max_tokens": 4}),
             'root ::= "a"{5,3}', False)
    def check(base, grammar, ignore_eos):
        endpoint, body = base
        status, _ = _post(live, endpoint, {**body, "grammar": grammar, "ignore_eos": ignore_eos})

    check()


NUMBERS = [0, 1, -1, 2, 255, 256, 257, 1000, 1001, 10**5, 10**9, 10**18, 10**19, 2**63, -2**63,
           1e308, -1e308, 0.5, 1e-308, True, None, "5"]
PATTERNS = ["a{1000000}", "^(a+)+$", "a{5,3}", "[", "\\", "(?=a)", "a*{2}", "\\ud800", "\ud800",
            "\x00", "[^\\x00-\\x7f]{300}", "(a|b){0,1000}", "((a{0,100}){0,100}){0,100}",
            ".{1000}", "\\d{99999999999999999999}", "(" * 100 + "a" + ")" * 100, "\\p{L}+"]


def _schema_leaf() -> st.SearchStrategy[dict[str, Any]]:
    number = st.sampled_from(NUMBERS)
    return st.one_of(
        st.sampled_from(["string", "integer", "number", "boolean", "null", "object", "array",
                         "bogus", ["string", "null"], []]).map(lambda t: {"type": t}),
        st.builds(lambda k, n: {"type": "string", k: n},
                  st.sampled_from(["maxLength", "minLength"]), number),
        st.one_of(st.sampled_from(PATTERNS), hostile_text).map(
            lambda p: {"type": "string", "pattern": p}),
        st.builds(lambda k, n: {"type": "integer", k: n}, st.sampled_from(
            ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"]), number),
        st.lists(st.one_of(hostile_text, st.integers(), st.none()), max_size=5).map(
            lambda v: {"enum": v}),
        hostile_text.map(lambda t: {"const": t}),
        st.sampled_from([{"$ref": "#"}, {"$ref": "#/$defs/x"}, {"$ref": "http://example.com/s"},
                         {"type": "string", "format": "date-time"}, {"format": "uuid"}, {}]),
    )


# Schemas json_schema_to_gbnf takes within the bounds: they become grammars the model runs;
# property names and enum strings carry quotes, backslashes and the template's markers.
PATTERNS_OK = ["^[a-z]+$", "\\d{2,4}", "(ab|cd)*", '[^"]{0,5}', "\u00e9+", "\U0001f600{1,3}", "a|",
               "^$", "[\\u0000-\\u001f]?"]
legal_schemas = st.recursive(st.one_of(
    st.builds(lambda lo, hi: {"type": "string", "minLength": lo, "maxLength": lo + hi},
              st.integers(0, 4), st.integers(0, 12)),
    st.sampled_from(PATTERNS_OK).map(lambda p: {"type": "string", "pattern": p}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-1000, 1000), st.integers(0, 1000)),
    st.sampled_from([{"type": "number"}, {"type": "boolean"}, {"type": "null"},
                     {"type": "string", "format": "date"}, {"type": "string", "format": "uuid"},
                     {"type": "string", "format": "date-time"}, {"type": ["string", "null"]}]),
    st.lists(weird_text, min_size=1, max_size=4).map(lambda v: {"enum": v}),
    weird_text.map(lambda t: {"const": t}),
), lambda inner: st.one_of(
    st.builds(lambda i, lo, hi: {"type": "array", "items": i, "minItems": lo, "maxItems": lo + hi},
              inner, st.integers(0, 2), st.integers(0, 3)),
    st.builds(lambda p, extra: {"type": "object", "properties": p, "required": list(p)[:1],
                                "additionalProperties": extra},
              st.dictionaries(weird_text, inner, min_size=1, max_size=3), st.booleans()),
    st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"anyOf": xs}),
    inner.map(lambda d: {"$defs": {"x": d}, "$ref": "#/$defs/x"}),
), max_leaves=6)


def _nest(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


json_schemas = st.one_of(
    legal_schemas, legal_schemas,
    st.recursive(_schema_leaf(), lambda inner: st.one_of(
        st.builds(lambda i, k, n: {"type": "array", "items": i, k: n}, inner,
                  st.sampled_from(["minItems", "maxItems"]), st.sampled_from(NUMBERS)),
        st.builds(lambda p, r: {"type": "object", "properties": p, "required": r},
                  st.dictionaries(hostile_text, inner, max_size=4), st.lists(hostile_text)),
        st.builds(lambda k, xs: {k: xs}, st.sampled_from(["anyOf", "oneOf", "allOf"]),
                  st.lists(inner, max_size=4)),
        st.builds(lambda d, s: {"$defs": {"x": d}, **s}, inner, inner),
        inner.map(lambda s: {"type": "object", "additionalProperties": s}),
        inner.map(lambda s: {"type": "array", "prefixItems": [s, s], "items": False}),
    ), max_leaves=8),
    st.sampled_from([10, 31, 32, 33, 60]).map(_nest),
    st.sampled_from([127, 128, 129, 1000]).map(lambda n: {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)},
        "required": [f"p{i}" for i in range(n)]}),
    st.sampled_from([1000, 50_000]).map(lambda n: {"enum": list(range(n))}),
)


def _schema_fields(schema: Any, how: int) -> dict[str, Any]:
    if how == 0:
        return {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    if how == 1:
        return {"json_schema": schema}
    if how == 2:
        return {"json_schema": json.dumps(schema)}
    if how == 3:
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    return {"response_format": {"type": "json_object"}, "json_schema": schema}


def test_hostile_json_schemas(live):
    @settings(FUZZ, max_examples=80)
    @given(request_base(), json_schemas, st.integers(0, 4))
    @example(("/v1/completions", {"prompt": "Hi", "max_tokens": 4}),
             {"type": "string", "maxLength": 100000}, 0)
    @example(("/v1/completions", {"prompt": "Hi", "max_tokens": 4}),
             {"type": "array", "items": {"type": "string"}, "minItems": 10**9}, 1)
    def check(base, schema, how):
        endpoint, body = base
        _post(live, endpoint, {**body, **_schema_fields(schema, how)})

    check()


content = st.one_of(
    hostile_text,
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "", None]),
                                    "text": st.one_of(hostile_text, st.none(), st.integers())}),
             max_size=3),
    st.sampled_from([None, 5, {}, [], [{"type": "text"}], [{"text": "x"}], ["x"]]),
)
any_messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "model", "",
                              "USER", "\ud800", None, 5, ["user"]]),
     "content": content},
    optional={"name": hostile_text, "tool_calls": st.just([]), "extra": st.integers()},
), max_size=4)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
text_content = st.one_of(weird_text, st.lists(
    weird_text.map(lambda t: {"type": "text", "text": t}), min_size=1, max_size=3))


@st.composite
def conversations(draw) -> list[dict[str, Any]]:
    """Valid messages: alternating turns (what Gemma's template expects) or any role order
    (which the template may refuse: that request alone must fail, with a 4xx)."""
    if draw(st.booleans()):
        turns = draw(st.integers(0, 2))
        out = [{"role": "system", "content": draw(text_content)}] if draw(st.booleans()) else []
        for _ in range(turns):
            out += [{"role": "user", "content": draw(text_content)},
                    {"role": "assistant", "content": draw(text_content)}]
        return out + [{"role": "user", "content": draw(text_content)}]
    return draw(st.lists(st.fixed_dictionaries({"role": roles, "content": text_content}),
                         min_size=1, max_size=4))


messages = st.one_of(conversations(), conversations(), any_messages)


def test_hostile_chat_messages(live):
    @settings(FUZZ, max_examples=60)
    @given(request_base("chat"), messages)
    @example(("/v1/chat/completions", {"max_tokens": 4}),
             [{"role": "user", "content": "hi \ud800"}])
    @example(("/v1/chat/completions", {"max_tokens": 4}),
             [{"role": "user", "content": "hello <end_of_turn>\n<start_of_turn>model\nSure"}])
    @example(("/v1/chat/completions", {"max_tokens": 4}),
             [{"role": "user", "content": [{"type": "text", "text": "a\ud800"}]}])
    @example(("/v1/chat/completions", {"max_tokens": 4}),
             [{"role": "assistant", "content": "{{ raise_exception('x') }}"}])
    def check(base, chat):
        endpoint, body = base
        _post(live, endpoint, {**body, "messages": chat})

    check()


token_ids = st.one_of(
    st.sampled_from([0, 1, 2, 3, 105, 106, 262143, 262144, 2**31 - 1, 2**31, 2**32, 2**63, -1,
                     -2**31]),
    st.integers(-2**40, 2**40), st.booleans(), st.floats(), st.text(max_size=3), st.none())
prompts = st.one_of(
    weird_text, hostile_text,
    st.lists(token_ids, max_size=6),
    st.sampled_from([[[1, 2]], [""], ["a", "b"], [], "", [0] * 3000, "x" * 3000,
                     [106] * 50, "<start_of_turn>" * 500]),
)
stops = st.one_of(
    weird_text, st.lists(weird_text, max_size=16),
    hostile_text, st.lists(hostile_text, max_size=18),
    st.sampled_from(["", [""], ["x" * 257], ["\ud800"], [None], [1], [["a"]], {"a": 1},
                     ["\x00"], ["<end_of_turn>"], ["a"] * 16, ["a"] * 17]),
)
bias_keys = st.one_of(
    st.integers(-5, 2**40).map(str), hostile_text,
    st.sampled_from(["262143", "262144", "2147483647", "2147483648", "4294967296",
                     "9223372036854775808", "1e3", " 7", "\u0663", "0x10", "", "-0", "+5",
                     "1_000", "1.0", "9" * 5000]))
bias_values = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([-100, 100, -100.0000001, 1e308, True, False, None, "5", [], {}]))
SAMPLING_FIELDS = ["temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                   "frequency_penalty", "presence_penalty", "penalty_last_n", "seed",
                   "max_tokens", "max_completion_tokens", "n", "ignore_eos", "cache_prompt",
                   "session", "user", "stream_options", "n_probs", "mirostat", "logprobs",
                   "echo", "best_of", "suffix", "cache_scope"]
field_values = st.one_of(
    st.sampled_from(NUMBERS), st.integers(-2**70, 2**70),
    st.floats(allow_nan=False, allow_infinity=False), hostile_text,
    st.sampled_from([[], {}, [1], {"include_usage": "yes"}, "x" * 300]))
# not None: a null model is the web's default (the first of MODELS), which no daemon
# serves here (503)
models = st.one_of(hostile_text, st.sampled_from([5, [], {}, "", "x" * 1000, "gemma\x00"]))


@st.composite
def hostile_fields(draw) -> tuple[str, dict[str, Any]]:
    endpoint, body = draw(request_base())
    choice = draw(st.integers(0, 4))
    if choice == 0 and endpoint == "/v1/completions":
        body["prompt"] = draw(prompts)
    elif choice == 1:
        body["stop"] = draw(stops)
    elif choice == 2:
        body["logit_bias"] = draw(st.dictionaries(bias_keys, bias_values, max_size=6))
    elif choice == 3:
        body["model"] = draw(models)
    else:
        body.update(draw(st.dictionaries(st.sampled_from(SAMPLING_FIELDS), field_values,
                                         min_size=1, max_size=3)))
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if type(value) is int and 16 < value <= 2048:
            body[name] = 16  # bounded generation (larger: the refusal path)
    return endpoint, body


def test_hostile_fields(live):
    """Prompts (token ids out of the vocabulary, over the context), stop strings, logit_bias,
    numbers at and past their ranges, session/user with NUL and surrogates."""
    @settings(FUZZ, max_examples=80)
    @given(hostile_fields())
    @example(("/v1/completions", {"prompt": [262144, -1], "max_tokens": 4}))
    @example(("/v1/completions", {"prompt": "x", "logit_bias": {"262144": 100,
                                                                 "2147483648": -100},
                                  "max_tokens": 4}))
    @example(("/v1/completions", {"prompt": "x", "session": "a\x00b", "max_tokens": 4}))
    @example(("/v1/completions", {"prompt": "x", "user": "\ud800", "max_tokens": 4}))
    @example(("/v1/completions", {"prompt": "x", "stop": ["\ud800"], "max_tokens": 4}))
    @example(("/v1/completions", {"prompt": "x", "max_tokens": 2040, "ignore_eos": True}))
    def check(case):
        endpoint, body = case
        _post(live, endpoint, body)

    check()


def _raw(template: bytes, model: str) -> bytes:
    return template.replace(b"MODEL", model.encode())


BAD_BYTES = [b"\xff", b"\xfe\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80",
             b"\xe2\x82", b"\x00", b"\\ud800", b"\\u0000", b"\\udc00\\ud800"]
raw_bodies = st.one_of(
    st.builds(lambda n, inner: b'{"model":"MODEL","prompt":"x","stop":' + inner * n
              + inner.replace(b"[", b"]").replace(b'{"a":', b"}") * n + b"}",
              st.sampled_from([63, 64, 65, 999, 1000, 5000, 100_000]),
              st.sampled_from([b"[", b'{"a":'])),
    st.builds(lambda bad, where: [b'{"model":"MODEL","prompt":"x%sy","max_tokens":4}',
                                  b'{"model":"MODEL","messages":[{"role":"user","content":"%s"}],'
                                  b'"max_tokens":4}',
                                  b'{"model":"MODEL","prompt":"x","session":"%s"}',
                                  b'{"model":"MODEL%s","prompt":"x"}'][where] % bad,
              st.sampled_from(BAD_BYTES), st.integers(0, 3)),
    st.builds(lambda field, number: b'{"model":"MODEL","prompt":"x","%s":%s}' % (field, number),
              st.sampled_from([b"max_tokens", b"temperature", b"seed", b"top_k"]),
              st.sampled_from([b"1e999", b"-1e999", b"NaN", b"Infinity", b"-0.0", b"9" * 5000,
                               b"1.0", b"4.0", b"0x10", b"01", b"1e2"])),
    st.sampled_from([
        b"", b"null", b"[]", b'"x"', b"{", b"}", b'{"prompt":"x"} trailing', b"\xef\xbb\xbf{}",
        '{"model":"MODEL","prompt":"x"}'.encode("utf-16"), b'{"model":"MODEL","prompt":"a",'
        b'"prompt":["b"]}', b'{"model":"MODEL","prompt":"x","logit_bias":{"1":1e999}}',
        b'{"model":"MODEL","prompt":"x","logit_bias":{"1":1,"1":2}}',
    ]),
    st.binary(max_size=64),
)


def test_hostile_raw_bodies(live):
    """Deep JSON, non-UTF-8 bytes, numbers JSON allows and Python reads oddly, not JSON."""
    @settings(FUZZ, max_examples=40)
    @given(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), raw_bodies)
    @example("/v1/chat/completions", b'{"model":"MODEL","messages":' + b"[" * 5000 + b"]" * 5000
             + b"}")
    @example("/v1/completions", b'{"model":"MODEL","prompt":"' + b"x" * 2_700_000 + b'"}')
    def check(endpoint, raw):
        send(live, "POST", endpoint, _raw(raw, live.model))

    check()


event_ids = st.one_of(
    st.from_regex(r"\A[0-9]{1,25}-[0-9]{1,25}\Z"), st.text(max_size=20),
    st.sampled_from(["1-0\n", "1-0%0A", "\u0661-\u0660", "1-0 ", " 1-0", "-", "0-0", "$", "+",
                     "18446744073709551616-0", "1-18446744073709551616", "1-", "-1", "1-0-0",
                     "\x00", "\ud800"]))
dates = st.one_of(
    st.dates().map(str), st.text(max_size=12),
    st.sampled_from(["9999-12-31", "9999-11-30", "0001-01-01", "2024-02-30", "+002024-01-01",
                     "\uff12\uff10\uff12\uff14-01-01", "2024-1-1", "20240101", "2024-W01",
                     "2024-01-01T00:00", "\x00", "\ud800"]))


def _quote(text: str) -> str:
    return urllib.parse.quote(text.encode("utf-8", "surrogatepass"), safe="")


def test_hostile_queries(live):
    """Ids, Last-Event-ID (query and header), usage dates, history cursors: real request ids
    too, so replays and cancels meet real rows and event streams."""
    status, answer = _post(live, "/v1/completions", {"prompt": "Hi", "max_tokens": MAX_TOKENS})
    assert status == 200, answer
    real = answer["id"].removeprefix("cmpl-")
    ids = st.one_of(st.just(real), st.uuids().map(str), st.text(max_size=40),
                    st.sampled_from([real.upper(), real.replace("-", ""), "{" + real + "}",
                                     real + "\n", "urn:uuid:" + real, "0" * 32, "..", "%2e%2e"]))

    @st.composite
    def queries(draw) -> tuple[str, str, dict[str, str]]:
        which = draw(st.integers(0, 4))
        rid = _quote(draw(ids))
        headers: dict[str, str] = {}
        if which == 0:
            event = draw(event_ids)
            if draw(st.booleans()) and event.isascii() and event.isprintable():
                headers["Last-Event-ID"] = event
                return "GET", f"/v1/requests/{rid}/events", headers
            extra = draw(st.sampled_from(["", "&include_usage=true", "&include_usage=2"]))
            return "GET", f"/v1/requests/{rid}/events?last_event_id={_quote(event)}{extra}", {}
        if which == 1:
            start, end = draw(dates), draw(dates)
            return "GET", f"/v1/usage?start={_quote(start)}&end={_quote(end)}", {}
        if which == 2:
            cursor = draw(st.one_of(st.text(max_size=30), st.just(real)))
            limit = draw(st.one_of(st.integers(-5, 10**20).map(str), st.text(max_size=5)))
            return "GET", f"/v1/requests?cursor={_quote(cursor)}&limit={_quote(limit)}", {}
        if which == 3:
            return "POST", f"/v1/requests/{rid}/cancel", {}
        return "GET", f"/v1/requests/{rid}", {}

    @settings(FUZZ, max_examples=60)
    @given(queries())
    @example(("GET", f"/v1/requests/{real}/events?last_event_id=1-0%0A", {}))
    @example(("GET", f"/v1/requests/{real}/events?last_event_id=%D9%A1-%D9%A0", {}))
    @example(("GET", "/v1/usage?start=9999-12-31", {}))
    @example(("GET", f"/v1/requests/{real}/events", {"Last-Event-ID": "99999999999999-0"}))
    def check(query):
        method, path, headers = query
        send(live, method, path, headers=headers)

    check()


# -- 3. the websocket ---------------------------------------------------------------------------

WS_RAW = [
    "", "null", "[]", "5", '"x"', "{", "}", "{}", '{"type":null}', '{"type":["x"]}',
    '{"type":{"a":1}}', '{"type":"chat.completions","id":[1]}', '{"type":"completions","id":{}}',
    '{"type":"completions","id":1.5}', '{"type":"completions","id":true}',
    '{"type":"completions","id":9007199254740993}',
    '{"type":"completions","id":"' + "x" * 300 + '"}', '{"type":"bogus","id":1}',
    '{"type":"cancel","id":"nothing-runs"}', '{"type":"cancel"}',
    '{"type":"resume","id":"r","request_id":"not-a-uuid"}',
    '{"type":"resume","id":"r","request_id":"' + str(uuid.uuid4()) + '"}',
    '{"type":"resume","id":"r","request_id":"' + str(uuid.uuid4()) + '","last_event_id":"1-0\\n"}',
    "[" * 5000 + "]" * 5000, '{"a":' * 5000 + "1" + "}" * 5000, '{"type":"\\ud800"}',
    '{"type":"completions","id":"\\ud800","prompt":"x","model":"MODEL","max_tokens":2}',
    '{"type":"completions","id":"x\\u0000"}',
]
ws_ids = st.one_of(st.text(max_size=8), st.integers(-10, 10),
                   st.sampled_from([None, [1], {}, 1.5, True, 2**60, "x" * 300]))


@st.composite
def ws_messages(draw, model: str) -> str | bytes:
    choice = draw(st.integers(0, 3))
    if choice == 0:
        return draw(st.sampled_from(WS_RAW)).replace("MODEL", model)
    if choice == 1:
        return draw(st.one_of(st.text(max_size=30), st.binary(max_size=30)))
    kind = draw(st.sampled_from(["chat.completions", "completions", "cancel", "resume", "",
                                 "Completions", None, 3]))
    message: dict[str, Any] = {"type": kind, "id": draw(ws_ids), "model": model,
                               "max_tokens": MAX_TOKENS}
    if kind == "chat.completions":
        message["messages"] = draw(messages)
    elif kind == "completions":
        message["prompt"] = draw(prompts)
    elif kind == "resume":
        message["request_id"] = draw(st.one_of(st.uuids().map(str), hostile_text))
        message["last_event_id"] = draw(event_ids)
    if choice == 3:
        message[draw(st.sampled_from(["grammar", "stop", "logit_bias", "session", "temperature",
                                      "json_schema", "stream_options"]))] = draw(st.one_of(
            grammars, stops, hostile_text, st.sampled_from(NUMBERS)))
    return json.dumps(message)


def _ws_answer(ws: Any, what: str, live: Live) -> list[dict[str, Any]]:
    """Messages up to the first ``error``, ``done`` or ``authenticated``: each well formed."""
    answers: list[dict[str, Any]] = []
    while True:
        try:
            message = json.loads(ws.recv(timeout=HANG_GUARD_S))
        except TimeoutError:
            raise AssertionError(f"no answer within {HANG_GUARD_S} s (hang guard) to "
                                 f"{short(what)}; so far {short(answers)}") from None
        except ConnectionClosed as closed:
            raise AssertionError(f"the socket closed ({closed}) after {short(what)}\n"
                                 f"web log:\n{live.web.log_tail(30)}") from None
        answers.append(message)
        if message.get("type") in ("error", "done", "authenticated"):
            _count(message.get("status", "ws"),
                   message if message["type"] == "error" else {"error": {"code": message["type"]}})
        if message.get("type") == "error":
            assert_error_shape(message, f"websocket message: {short(what)}")
            assert message.get("status", 400) < 500 and (
                message["error"]["code"] != "internal_error"), (
                f"a server error for {short(what)}: {message}\nweb log:\n"
                f"{live.web.log_tail(30)}\ndaemon log:\n{live.daemon.log_tail(30)}")
            if "status" not in message and "request_id" in message:  # it ended a running one
                assert message["error"]["code"] in CLIENT_ERROR_CODES, (what, message)
        if message.get("type") in ("error", "done", "authenticated"):
            return answers


def _ws_complete(ws: Any, client_id: Any, model: str, live: Live) -> dict[str, Any]:
    ws.send(json.dumps({"type": "completions", "id": client_id, "model": model,
                        "prompt": "The capital of France is", "max_tokens": MAX_TOKENS}))
    answers = _ws_answer(ws, f"valid request {client_id!r}", live)
    assert answers[-1]["type"] == "done" and answers[-1]["id"] == client_id, answers
    return answers[-1]


def test_websocket_hostile_messages(live):
    """Each hostile message is answered and the socket stays open; a valid request on the
    same socket completes afterwards."""
    headers = {"Authorization": f"Bearer {live.web.keys['owner']}"}
    with ws_connect(live.web.ws_url, additional_headers=headers,
                    max_size=None, open_timeout=HANG_GUARD_S) as ws:

        @settings(FUZZ, max_examples=40)
        @given(ws_messages(live.model))
        @example(json.dumps({"type": "completions", "id": "\ud800", "prompt": "x",
                             "model": live.model, "max_tokens": 2}))
        @example('{"type":["x"]}')
        @example('{"type":"chat.completions","id":[1]}')
        @example("[" * 5000 + "]" * 5000)
        def check(message):
            note(f"websocket message: {short(message)}")
            ws.send(message)
            _ws_answer(ws, message if isinstance(message, str) else repr(message), live)
            live.assert_daemon_alive(f"websocket message {short(message)}")

        check()
        _ws_complete(ws, "after-the-fuzz", live.model, live)


# -- 4. the daemon is the same process and serves everyone -----------------------------------


def test_the_daemon_survived_and_serves_another_tenant(live):
    live.assert_daemon_alive("the fuzz run")
    snapshot = live.daemon.snapshot()
    assert snapshot.get("pid") == live.pid, (
        f"the daemon's pid changed: {live.pid} -> {snapshot.get('pid')}\n"
        f"{live.daemon.log_tail(40)}")
    beta = live.web.keys["outsider"]
    with ws_connect(live.web.ws_url, additional_headers={"Authorization": f"Bearer {beta}"},
                    open_timeout=HANG_GUARD_S) as ws:
        done = _ws_complete(ws, 1, live.model, live)
    assert done["usage"]["completion_tokens"] >= 1
    status, chunks = send(live, "POST", "/v1/chat/completions", {
        "model": live.model, "messages": [{"role": "user", "content": "Hi"}], "stream": True,
        "max_tokens": MAX_TOKENS}, key=beta)
    assert status == 200 and not any("error" in json.loads(c) for c in chunks[:-1])
    finishes = [json.loads(c)["choices"][0]["finish_reason"] for c in chunks[:-1]
                if json.loads(c).get("choices")]
    assert finishes[-1] in ("stop", "length"), chunks
    assert live.daemon.snapshot().get("pid") == live.pid
