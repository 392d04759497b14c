"""Tenants' grammars and JSON schemas are checked before llama.cpp's grammar parser sees them
(``wire/grammar_check.py``, ``wire/schema_check.py``): the unit tests need no model; the
differential tests (slow) run llama.cpp's own parser in a throwaway subprocess."""

from __future__ import annotations

import inspect
import json
import os
import random
import resource
import select
import subprocess
import sys
import textwrap

import pytest

from wire import grammar_check as gc
from wire import schema_check as sc
from wire.errors import InvalidParameter
from wire.grammar_check import check_grammar, grammar_stats
from wire.sampling import SamplingParams
from wire.schema_check import check_json_schema

# llama.cpp's grammars/json.gbnf (MIT licence), as vendored in llama-cpp-python 0.3.36.
LLAMA_JSON_GBNF = r"""root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"""

# The inputs from issue 12 that killed the daemon, and others found while measuring.
ISSUE_NESTED_PARENS = "root ::= " + "(" * 20000 + '"a"' + ")" * 20000  # SIGSEGV
ISSUE_SCHEMA = {"type": "string", "maxLength": 100000}  # its grammar: SIGSEGV
ISSUE_SURROGATE = 'root ::= "hi \ud800"'  # UnicodeEncodeError in gbnf.encode()
MIN_ABOVE_MAX = 'root ::= "a"{5,3}'  # llama.cpp loops allocating rules: std::bad_alloc / OOM
# llama.cpp misses left recursion through a rule that is only nullable indirectly and
# then loops in llama_grammar_advance_stack until memory runs out (SIGABRT)
NULLABLE_LEFT_RECURSION = 'root ::= n root "x" | "y"\nn ::= m\nm ::= "" | "z"\n'
# exponential work in llama.cpp (left-recursion scan, initial parse stacks)
DIAMOND = (
    "root ::= r0\n"
    + "".join(f'r{i} ::= r{i + 1} "x" | r{i + 1} "y"\n' for i in range(30))
    + 'r30 ::= "z"\n'
)
CRASHERS = [ISSUE_NESTED_PARENS, MIN_ABOVE_MAX, NULLABLE_LEFT_RECURSION, DIAMOND]


def refused(text: str, field: str = "grammar") -> str:
    with pytest.raises(InvalidParameter) as info:
        check_grammar(text, field)
    assert info.value.param == field
    assert info.value.message.startswith(f"{field}: ")
    return info.value.message


def schema_refused(schema: object, field: str = "json_schema") -> str:
    with pytest.raises(InvalidParameter) as info:
        check_json_schema(schema, field)
    assert info.value.param == field
    return info.value.message


def nested(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


# -- accepted ------------------------------------------------------------------------------

VALID = [
    'root ::= "a"',
    "root ::=",  # matches the empty string
    LLAMA_JSON_GBNF,
    'root ::= "a" b # comment\n'
    'b ::= [a-z0-9_]+ | "\\x41\\u00e9\\U0001F600\\t\\r\\n\\\\\\"\\[\\]\\-"\n',
    'root ::= ("x"\n  | "y"\n  )*\r\n',
    'root ::= [^"\\\\] [a-] [-a] [\\]] [] [^] . ""',
    'root ::= <[12]> !<[3]> "a"{2} "b"{0,3} "c"{1,} "d"{ 2 , 4 } "e"? "f"*',
    'root ::= "é" [α-ω] "日本"',
    'root ::= a "." a\na ::= "b" a | ""',  # right recursion, a nullable rule
    'root ::= "a"\nroot ::= "b"',  # a rule defined twice: the last definition wins
]


@pytest.mark.parametrize("text", VALID)
def test_valid_grammars_are_accepted(text):
    assert check_grammar(text) == text


def test_llama_cpp_json_gbnf_is_accepted_well_inside_the_limits():
    stats = grammar_stats(LLAMA_JSON_GBNF)
    assert stats["rules"] < gc.MAX_RULES // 10
    assert stats["elements"] < gc.MAX_ELEMENTS // 100
    assert stats["stacks"] <= gc.MAX_STACKS // 8
    assert stats["advance_work"] < gc.MAX_ADVANCE_WORK // 100
    assert stats["left_scan"] < gc.MAX_LEFT_SCAN_WORK // 100


# -- the issue's inputs --------------------------------------------------------------------


def test_twenty_thousand_nested_parentheses_are_refused():
    assert f"nesting deeper than {gc.MAX_NESTING} levels" in refused(ISSUE_NESTED_PARENS)


def test_lone_surrogate_in_a_grammar_is_refused():
    assert "not valid Unicode" in refused(ISSUE_SURROGATE)
    with pytest.raises(InvalidParameter) as info:
        SamplingParams.from_dict({"grammar": ISSUE_SURROGATE})
    assert info.value.param == "grammar"


def test_the_issue_schema_is_refused_before_conversion():
    message = schema_refused(ISSUE_SCHEMA)
    assert f"maxLength above {sc.MAX_SCHEMA_COUNT}" in message
    with pytest.raises(InvalidParameter) as info:
        SamplingParams.from_dict({"json_schema": ISSUE_SCHEMA})
    assert info.value.param == "json_schema"


def test_nested_parentheses_through_from_dict_are_a_400_on_the_grammar_field():
    with pytest.raises(InvalidParameter) as info:
        SamplingParams.from_dict({"grammar": ISSUE_NESTED_PARENS})
    assert info.value.param == "grammar" and info.value.code == "invalid_request_error"


# -- limits ----------------------------------------------------------------------------------


def test_nesting_limit_is_exact():
    check_grammar(nested(gc.MAX_NESTING))
    assert f"nesting deeper than {gc.MAX_NESTING} levels" in refused(nested(gc.MAX_NESTING + 1))


def test_size_limit_counts_utf8_bytes():
    body = "a" * (gc.MAX_GRAMMAR_BYTES - len('root ::= ""'))
    check_grammar(f'root ::= "{body}"')
    assert f"longer than {gc.MAX_GRAMMAR_BYTES} bytes" in refused(f'root ::= "{body}a"')
    wide = "é" * ((gc.MAX_GRAMMAR_BYTES - 20) // 2 + 20)  # fewer characters than bytes
    assert f"longer than {gc.MAX_GRAMMAR_BYTES} bytes" in refused(f'root ::= "{wide}"')


def test_nul_is_refused():
    assert "NUL" in refused('root ::= "a"\x00 junk')


@pytest.mark.parametrize(
    "text, needle",
    [
        (f'root ::= "a"{{{gc.MAX_REPETITION + 1}}}', f"repetition count above {gc.MAX_REPETITION}"),
        (
            f'root ::= "a"{{0,{gc.MAX_REPETITION + 1}}}',
            f"repetition count above {gc.MAX_REPETITION}",
        ),
        ('root ::= "a"{99999999999999999999999}', "repetition count above"),
        (MIN_ABOVE_MAX, "minimum above maximum"),
        ('root ::= ("a"{0,40}){50}', "nested repetitions multiply"),
        ('root ::= "' + "a" * 1000 + '"{1000}', f"more than {gc.MAX_ELEMENTS} grammar elements"),
        ("root ::= {2}", "expecting an item"),
        ('root ::= "a"{,2}', "expecting an integer"),
        ('root ::= "a"{2', "expecting ',' or '}'"),
    ],
)
def test_repetitions_are_bounded(text, needle):
    assert needle in refused(text)


def test_repetition_at_the_limit_is_accepted():
    check_grammar(f'root ::= "a"{{{gc.MAX_REPETITION}}} "b"{{0,{gc.MAX_REPETITION}}}')


def test_rule_count_is_bounded():
    rules = "".join(f'r{i} ::= "x"\n' for i in range(gc.MAX_RULES))
    assert f"more than {gc.MAX_RULES} rules" in refused('root ::= "a"\n' + rules)
    # generated rules count too: each optional repetition is a rule in llama.cpp
    many = " ".join(['"a"{0,900}'] * 5)
    assert f"more than {gc.MAX_RULES} rules" in refused(f"root ::= {many}")


@pytest.mark.parametrize(
    "text, needle",
    [
        ("root ::= x", "rule 'x' is used but not defined"),
        ('x ::= "a"', "no 'root' rule"),
        ("# only a comment\n", "has no rules"),
        ('root ::= "a"\n  | "b"', "expecting a rule name"),  # llama.cpp: newline ends a rule
        ('root ::= ("a"', "expecting ')'"),
        ('root ::= "a" )', "expecting newline or end"),
        ('root := "a"', "expecting ::="),
        ('root ::= "a\\q"', "unknown escape"),
        ('root ::= "\\x4"', "hex digits"),
        ('root ::= "abc', "unexpected end of input"),
        ("root ::= [a-", "unexpected end of input"),
        ("root ::= <hello>", "token names"),
        ("root ::= <[99999999999]>", "token id above"),
        ("root ::= !x", "expecting '<'"),
    ],
)
def test_malformed_grammars_are_refused_like_llama_cpp_does(text, needle):
    assert needle in refused(text)


@pytest.mark.parametrize(
    "text",
    [
        'root ::= root "a" | "b"',
        'root ::= a "x"\na ::= root | "y"',
        'root ::= "" root "x" | "y"',
        'root ::= ("a")? root | "b"',
        NULLABLE_LEFT_RECURSION,  # llama.cpp itself misses this one
    ],
)
def test_left_recursion_is_refused(text):
    assert "left-recursive" in refused(text)


def test_exponential_grammars_are_refused():
    assert "too ambiguous" in refused(DIAMOND)
    hidden = DIAMOND.replace("root ::= r0", 'root ::= "a" r0')  # not reached at start
    assert "too ambiguous" in refused(hidden)
    many = "root ::= " + " | ".join(f'"{i}"' for i in range(gc.MAX_STACKS + 1))
    assert f"more than {gc.MAX_STACKS} ways" in refused(many)
    check_grammar("root ::= " + " | ".join(f'"{i}"' for i in range(gc.MAX_STACKS)))


def chain(n: int, tail: str = "") -> str:
    """root -> r1 -> r2 ... -> rn, each rule starting with the next."""
    rules = "".join(f"r{i} ::= r{i + 1}{tail}\n" for i in range(1, n))
    return f'root ::= r1{tail}\n{rules}r{n} ::= "y"\n'


def test_long_left_chains_are_refused():
    check_grammar(chain(gc.MAX_LEFT_DEPTH - 1))
    assert f"more than {gc.MAX_LEFT_DEPTH} rules" in refused(chain(gc.MAX_LEFT_DEPTH + 1))


def test_stacks_that_grow_along_a_chain_are_bounded():
    """r1 "x" leaves "x" on the stack: llama.cpp copies ever longer stacks (quadratic)."""
    stats = grammar_stats(chain(400, ' "x"'))
    assert stats["advance_work"] > 400 * 400
    assert f"more than {gc.MAX_ADVANCE_WORK} steps" in refused(chain(600, ' "x"'))


def test_not_a_grammar():
    for value in (None, 5, "", "  \n", ["root ::= x"]):
        refused(value)  # type: ignore[arg-type]


def test_the_checker_never_recurses():
    """Deep input under a recursion limit barely above the caller's depth: iterative."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 60)
    try:
        refused(ISSUE_NESTED_PARENS)
        check_grammar(nested(gc.MAX_NESTING))
        refused(DIAMOND)
        refused("root ::= " + "(" * (gc.MAX_GRAMMAR_BYTES - 20))
        check_grammar(chain(gc.MAX_LEFT_DEPTH - 1))
        schema_refused(deep_schema(100_000))
    finally:
        sys.setrecursionlimit(limit)


# -- JSON schemas --------------------------------------------------------------------------


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


TYPICAL_SCHEMAS = [
    {"type": "object"},
    {"type": "string", "maxLength": sc.MAX_SCHEMA_OPTIONAL},
    {"type": "string", "minLength": sc.MAX_SCHEMA_COUNT, "maxLength": sc.MAX_SCHEMA_COUNT},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 64},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+[.][a-z]{2,6}$"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
            "role": {"enum": ["admin", "user", "guest"]},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"],
            },
            "maxLength": {"type": "boolean"},  # a property named like a keyword
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {"type": "array", "prefixItems": [{"type": "number"}, {"const": {"maxItems": "x"}}]},
    {"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]},
    {
        "type": "object",
        "properties": {"n": {"$ref": "#/$defs/x"}},
        "$defs": {"x": {"type": "integer"}},
    },
    {"type": "integer", "exclusiveMinimum": True, "minimum": -(10**18)},
    {"enum": [f"code-{i}" for i in range(100)]},
    deep_schema(sc.MAX_SCHEMA_DEPTH - 1),
]


@pytest.mark.parametrize("schema", TYPICAL_SCHEMAS)
def test_typical_schemas_are_accepted(schema):
    assert json.loads(check_json_schema(schema)) == schema
    params = SamplingParams.from_dict({"json_schema": json.dumps(schema)})
    assert json.loads(params.json_schema) == schema


@pytest.mark.parametrize(
    "schema, needle",
    [
        ({"type": "string", "minLength": sc.MAX_SCHEMA_COUNT + 1}, "minLength above"),
        ({"type": "array", "minItems": 10**8}, "minItems above"),
        (
            {"type": "string", "maxLength": sc.MAX_SCHEMA_OPTIONAL + 1},
            "maxLength - minLength above",
        ),
        ({"type": "string", "minLength": 5, "maxLength": 4}, "minLength is greater than maxLength"),
        ({"type": "array", "maxItems": 1.5}, "maxItems must be a non-negative integer"),
        ({"type": "object", "maxProperties": True}, "must be a non-negative integer"),
        ({"type": "string", "pattern": "^a{0,100000}$"}, "quantifier count above"),
        (
            {"type": "string", "pattern": f"^a{{0,{sc.MAX_SCHEMA_OPTIONAL + 1}}}$"},
            "optional repetitions",
        ),
        ({"type": "string", "pattern": "^a{5,3}$"}, "min > max"),
        (
            {"type": "string", "pattern": "^" + "(" * 40 + "a" + ")" * 40 + "$"},
            "groups nested deeper",
        ),
        ({"type": "string", "pattern": 5}, "pattern must be a string"),
        ({"type": "number", "minimum": 1e300}, "at most 18 digits"),
        ({"type": "number", "maximum": "9"}, "maximum must be a number"),
        ({"enum": ["a\ud800"]}, "not valid Unicode"),
        ({"properties": {"\ud800": {}}}, "not valid Unicode"),
        ({"enum": ["a\x00"]}, "NUL"),
        ({"const": float("nan")}, "finite"),
        (deep_schema(sc.MAX_SCHEMA_DEPTH + 1), f"nested deeper than {sc.MAX_SCHEMA_DEPTH}"),
        (deep_schema(100_000), f"nested deeper than {sc.MAX_SCHEMA_DEPTH}"),
        ({"enum": ["x" * 1000] * 100}, f"longer than {sc.MAX_SCHEMA_BYTES} bytes"),
        ({"enum": list(range(sc.MAX_SCHEMA_NODES + 1))}, f"more than {sc.MAX_SCHEMA_NODES} values"),
        ({"properties": {f"p{i}": {} for i in range(sc.MAX_SCHEMA_PROPERTIES + 1)}}, "properties"),
        ({1: "x"}, "keys must be strings"),
        ({"enum": {1, 2}}, "not JSON"),
        ([{"type": "string"}], "must be a JSON object"),
    ],
)
def test_schema_bounds(schema, needle):
    assert needle in schema_refused(schema)


def test_schema_text_from_the_wire():
    deep = "[" * 100_000 + "]" * 100_000  # json.loads would raise RecursionError
    with pytest.raises(InvalidParameter) as info:
        SamplingParams.from_dict({"json_schema": '{"a": ' + deep + "}"})
    assert info.value.param == "json_schema"
    with pytest.raises(InvalidParameter):
        SamplingParams.from_dict({"json_schema": " " * (sc.MAX_SCHEMA_BYTES + 1) + "{}"})
    with pytest.raises(InvalidParameter):  # Python's int parsing limit: ValueError
        SamplingParams.from_dict({"json_schema": '{"minimum": ' + "9" * 5000 + "}"})
    params = SamplingParams.from_dict({"json_schema": '{"type": "string", "maxLength": 8}'})
    assert params.json_schema == '{"maxLength": 8, "type": "string"}'


# -- engine.grammar_for: the GBNF a schema turns into is checked too ------------------------


@pytest.fixture
def grammar_for():
    pytest.importorskip("llama_cpp")
    from scheduler_daemon.llama.engine import LlamaEngine

    return lambda params: LlamaEngine.grammar_for(None, params)  # uses no engine state


def test_grammar_for_checks_the_converted_grammar(grammar_for):
    schema = {"enum": [f"v{i}" for i in range(gc.MAX_STACKS + 1)]}  # fine as a schema
    params = SamplingParams.from_dict({"json_schema": schema})
    with pytest.raises(InvalidParameter) as info:
        grammar_for(params)
    assert info.value.param == "json_schema"
    assert "its grammar is refused" in info.value.message and "ways" in info.value.message


@pytest.mark.parametrize("schema", TYPICAL_SCHEMAS)
def test_grammar_for_accepts_typical_schemas(grammar_for, schema):
    field, gbnf = grammar_for(SamplingParams.from_dict({"json_schema": schema}))
    assert field == "json_schema" and check_grammar(gbnf) == gbnf


def test_grammar_for_checks_a_raw_grammar_that_skipped_from_dict(grammar_for):
    with pytest.raises(InvalidParameter) as info:
        grammar_for(SamplingParams(grammar=ISSUE_NESTED_PARENS))
    assert info.value.param == "grammar"
    assert grammar_for(SamplingParams(grammar='root ::= "a"')) == ("grammar", 'root ::= "a"')


def test_grammar_for_refuses_what_the_converter_gets_wrong(grammar_for):
    """The converter copies a regex escape llama.cpp does not know (``\\.``) into the GBNF:
    refused here, instead of reaching llama.cpp's error path (which prints the grammar)."""
    params = SamplingParams.from_dict({"json_schema": {"type": "string", "pattern": "^a\\.b$"}})
    with pytest.raises(InvalidParameter) as info:
        grammar_for(params)
    assert info.value.param == "json_schema" and "unknown escape" in info.value.message


# -- differential: llama.cpp's parser in a subprocess ---------------------------------------

_CHILD = textwrap.dedent(
    """
    import ctypes, json, sys
    import llama_cpp as lc
    quiet = lc.llama_log_callback(lambda level, text, data: None)
    lc.llama_log_set(quiet, ctypes.c_void_p(0))
    lc.llama_backend_init()
    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(sys.argv[1].encode(), params)
    vocab = lc.llama_model_get_vocab(model) if model else None
    print("RESULT ready" if model else "RESULT no-model", flush=True)
    for line in sys.stdin:
        sampler = lc.llama_sampler_init_grammar(vocab, json.loads(line).encode(), b"root")
        print("RESULT ok" if sampler else "RESULT refused", flush=True)
        if sampler:
            lc.llama_sampler_free(sampler)
    """
)
# Only a broken checker lets the parser run this long (accepted grammars parse in ms).
_HANG_GUARD_S = 300


class LlamaGrammarParser:
    """llama.cpp's ``llama_sampler_init_grammar`` in a child process, restarted if it dies.

    ``parse`` answers "ok", "refused" (llama.cpp's parser said no) or "died: <returncode>".
    The child's stderr is kept: llama.cpp prints a grammar it refuses there."""

    def __init__(self, model: str, stderr_path: str) -> None:
        self.model = model
        self.stderr_path = stderr_path
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        def limits() -> None:  # a runaway parse hits bad_alloc, not the machine's memory
            resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, self.model],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.stderr_path, "ab"),  # noqa: SIM115 (the child holds it)
            text=True,
            preexec_fn=limits,
            env={**os.environ, "GGML_NO_BACKTRACE": "1"},
        )
        assert self._answer() == "ready"

    def _answer(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], _HANG_GUARD_S)
            if not ready:
                self.proc.kill()
                self.proc.wait()
                return "died: hung"
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                return f"died: {self.proc.returncode}"
            if line.startswith("RESULT "):
                return line[len("RESULT ") :].strip()

    def parse(self, text: str) -> str:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(text) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        answer = self._answer()
        if answer.startswith("died"):
            self.proc = None
        return answer

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait()


@pytest.fixture(scope="module")
def llama_parser(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from .conftest import model_path

    stderr_path = str(tmp_path_factory.mktemp("llama") / "stderr.txt")
    parser = LlamaGrammarParser(model_path(), stderr_path)
    yield parser
    parser.close()
    with open(stderr_path, encoding="utf-8", errors="replace") as f:
        assert "error parsing grammar" not in f.read(), "a grammar reached llama.cpp's error path"


def accepted(text: str) -> bool:
    try:
        check_grammar(text)
    except InvalidParameter:
        return False
    return True


def assert_llama_parses(parser: LlamaGrammarParser, text: str) -> None:
    """The differential property: what the checker accepts, llama.cpp parses (so what
    llama.cpp refuses, or dies on, the checker refuses)."""
    if accepted(text):
        answer = parser.parse(text)
        assert answer == "ok", f"checker accepted, llama.cpp {answer}: {text[:300]!r}"


# grammar pieces for generated corpora: valid ones, near misses and plain junk
NAMES = ["root", "a", "b", "x-1"]
ATOMS = [
    '"x"',
    '"ab"',
    '""',
    '"\\n"',
    '"\\x41"',
    '"\\u00e9"',
    '"\\U0001F600"',
    '"\\\\"',
    '"\\""',
    '"é"',
    "[a-z]",
    "[0-9]",
    "[^x]",
    '[^"\\\\]',
    "[a-]",
    "[-a]",
    "[\\]]",
    "[]",
    "[é-ü]",
    ".",
    "<[1]>",
    "!<[2]>",
]
QUANTIFIERS = ["*", "+", "?", "{2}", "{0,3}", "{1,}", "{2,2}", "{ 1 , 2 }", "{0}"]
JUNK = [
    "(",
    ")",
    "|",
    "*",
    "+",
    "?",
    "{",
    "}",
    ",",
    "{3,1}",
    "{,2}",
    '"',
    "[",
    "]",
    "-",
    "\\",
    "<",
    ">",
    "!",
    "::=",
    ":",
    "=",
    "\n",
    "\r\n",
    "\r",
    " ",
    "\t",
    "#c\n",
    "# c",
    "<[99999999999]>",
    "\\q",
    "\\x4",
    "c",
    "root",
    "a",
]


def random_grammar(rng: random.Random) -> str:
    names = NAMES[: rng.randint(1, len(NAMES))]

    def expr(depth: int) -> str:
        k = rng.randrange(5 if depth < 2 else 3)
        if k == 0:
            return rng.choice(ATOMS)
        if k == 1:
            return "c" if rng.random() < 0.003 else rng.choice(names)
        if k == 2:
            return rng.choice([a for a in ATOMS if a not in ('""', "[]")]) + quantifiers()
        if k == 3:
            return "(" + alternates(depth + 1) + ")"
        return "(" + alternates(depth + 1) + ")" + quantifiers()

    def quantifiers() -> str:
        return "".join(rng.choice(QUANTIFIERS[:-2]) for _ in range(rng.randint(0, 1))) + (
            rng.choice(QUANTIFIERS) if rng.random() < 0.9 else ""
        )

    def alternates(depth: int) -> str:
        bar = rng.choice([" | ", "\n | ", " |\n "]) if depth else " | "
        return bar.join(sequence(depth) for _ in range(rng.randint(1, 3)))

    def sequence(depth: int) -> str:
        items = [expr(depth) for _ in range(rng.randint(0 if depth else 1, 3))]
        if not depth and rng.random() < 0.9:  # mostly no left recursion
            items.insert(0, rng.choice(ATOMS[:10]))
        return " ".join(items)

    text = "\n".join(f"{name} ::= {alternates(0)}" for name in names)
    if rng.random() < 0.3:  # mutate: insert, delete or replace a few pieces
        chars = list(text)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(chars) + 1)
            op = rng.randrange(3)
            if op == 0 and chars:
                del chars[min(i, len(chars) - 1)]
            elif op == 1:
                chars.insert(i, rng.choice(JUNK))
            elif chars:
                chars[min(i, len(chars) - 1)] = rng.choice(JUNK)
        text = "".join(chars)
    return text


SCHEMA_CORPUS = (
    TYPICAL_SCHEMAS
    + [{"type": "string", "maxLength": n} for n in (1, 2, 64, sc.MAX_SCHEMA_OPTIONAL)]
    + [
        {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 200},
        {"type": "string", "pattern": "^(ab|c[d-f]{2,5})+x?$"},
        {"type": "object", "properties": {f"p{i}": {"type": "number"} for i in range(100)}},
        {"oneOf": [{"type": "boolean"}, {"type": "array", "items": {"type": "object"}}]},
    ]
)


@pytest.mark.slow
def test_differential_known_corpus(llama_parser):
    """llama.cpp's sample grammar, hand-written edge cases and the converter's output for
    typical schemas: the checker accepts them all and llama.cpp parses them all."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    corpus = VALID + [json_schema_to_gbnf(check_json_schema(s)) for s in SCHEMA_CORPUS]
    for text in corpus:
        assert accepted(text), text[:300]
        assert llama_parser.parse(text) == "ok", text[:300]


@pytest.mark.slow
def test_differential_crashers_never_reach_llama_cpp(llama_parser):
    """The grammars that kill or stall llama.cpp are refused (were they accepted, the
    child would die here: the test shows how)."""
    for text in CRASHERS:
        assert_llama_parses(llama_parser, text)
        assert not accepted(text)


@pytest.mark.slow
def test_differential_generated_corpus(llama_parser):
    """Thousands of generated grammars (valid, near-miss, mutated): nothing the checker
    accepts is refused by llama.cpp or kills it, and the checker is not vacuous."""
    rng = random.Random(12)
    n_accepted = 0
    for _ in range(3000):
        text = random_grammar(rng)
        assert_llama_parses(llama_parser, text)
        n_accepted += accepted(text)
    assert n_accepted > 250  # 286 of 3,000: the sampling-cost pricing refuses ~40 more


@pytest.mark.slow
def test_differential_hypothesis(llama_parser):
    """The same property over hypothesis-generated grammars (shrunk on failure)."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    text_chars = st.characters(exclude_categories=("Cs",), exclude_characters='\x00"\\')
    atom = st.one_of(
        st.sampled_from(ATOMS),
        st.sampled_from(NAMES),
        st.text(text_chars, max_size=4).map(lambda s: f'"{s}"'),
    )
    expr = st.recursive(
        atom,
        lambda inner: st.one_of(
            st.tuples(inner, st.sampled_from(QUANTIFIERS)).map("".join),
            st.lists(st.lists(inner, max_size=3).map(" ".join), min_size=1, max_size=3).map(
                lambda alts: "(" + " | ".join(alts) + ")"
            ),
        ),
        max_leaves=10,
    )
    body = st.lists(st.lists(expr, max_size=4).map(" ".join), min_size=1, max_size=3).map(
        " | ".join
    )
    grammar = st.lists(body, min_size=1, max_size=len(NAMES)).map(
        lambda bodies: "\n".join(f"{n} ::= {b}" for n, b in zip(NAMES, bodies, strict=False))
    )
    junk = st.lists(st.sampled_from(JUNK + ATOMS + NAMES), max_size=12).map(" ".join)
    mutated = st.tuples(
        grammar, st.lists(st.tuples(st.integers(0, 400), st.sampled_from(JUNK)), max_size=3)
    ).map(lambda gm: _mutate(*gm))

    @hypothesis.settings(
        max_examples=1500,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(st.one_of(grammar, mutated, junk.map(lambda j: "root ::= " + j)))
    def check(text):
        assert_llama_parses(llama_parser, text)
        seen[accepted(text)] += 1

    seen = [0, 0]
    check()
    assert seen[True] > 100, seen  # not vacuous: many generated grammars are accepted


def _mutate(text: str, edits: list[tuple[int, str]]) -> str:
    for at, piece in edits:
        at = at % (len(text) + 1)
        text = text[:at] + piece + text[at:]
    return text


# -- the sampler's cost (wire/grammar_cost.py) ---------------------------------------------


def alternatives_under_repetition(k: int) -> str:
    """Issue 31's grammar: k alternatives of the same class under ``+`` (k^n paths)."""
    return (
        "root ::= item+\nitem ::= "
        + " | ".join(f"c{i}" for i in range(k))
        + "\n"
        + "".join(f"c{i} ::= [a-z ]\n" for i in range(k))
    )


def test_sixteen_equal_alternatives_under_repetition_are_refused_with_the_limit():
    text = alternatives_under_repetition(16)
    message = refused(text)
    assert "too ambiguous" in message and f"{gc.MAX_SAMPLING_VISITS}" in message


@pytest.mark.parametrize("k", [2, 4])
def test_fewer_equal_alternatives_under_repetition_are_refused_too(k):
    assert "too ambiguous" in refused(alternatives_under_repetition(k))


def test_one_alternative_under_repetition_is_cheap():
    stats = grammar_stats(alternatives_under_repetition(1))
    assert stats["sampling_visits"] < gc.MAX_SAMPLING_VISITS // 100


def test_the_ambiguity_is_found_behind_a_long_prefix():
    """Past the longest token from root: priced from the repeated rule's own start."""
    text = 'root ::= "q"{40} item+\nitem ::= a | b\na ::= [a-z]\nb ::= [a-z]\n'
    assert "too ambiguous" in refused(text)


def test_doubling_stacks_are_refused():
    assert "too ambiguous" in refused('root ::= s\ns ::= "a" s "b" | "a" s "c" | ""\n')


def test_json_gbnf_and_schema_grammars_are_priced_under_the_limit():
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    assert grammar_stats(LLAMA_JSON_GBNF)["sampling_visits"] < gc.MAX_SAMPLING_VISITS / 4
    for schema in TYPICAL_SCHEMAS:
        gbnf = json_schema_to_gbnf(json.dumps(schema))
        assert grammar_stats(gbnf)["sampling_visits"] < gc.MAX_SAMPLING_VISITS / 4


def test_tool_call_grammars_are_priced_under_the_limit():
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    from inference import tools

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14}}}}}
    search = {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "required": ["query"], "properties": {
            "query": {"type": "string", "pattern": "^[a-z ]{1,40}$"},
            "tags": {"type": "array", "items": {"type": "string"}}}}}}
    for choice in ("auto", "required"):
        plan = tools.plan({"tools": [weather, search], "tool_choice": choice})
        gbnf = json_schema_to_gbnf(json.dumps(plan.schema))
        assert grammar_stats(gbnf)["sampling_visits"] < gc.MAX_SAMPLING_VISITS / 4


def test_a_schema_whose_grammar_is_too_ambiguous_is_refused_on_its_field(grammar_for):
    # anyOf of equal string schemas under an array: each element matches k ways
    schema = {"type": "array", "items": {"anyOf": [
        {"type": "string", "pattern": f"^[a-z]{{1,{10 + i}}}$"} for i in range(8)]}}
    with pytest.raises(InvalidParameter) as info:
        grammar_for(SamplingParams.from_dict({"json_schema": schema}))
    assert info.value.param == "json_schema" and "too ambiguous" in info.value.message


def decoys_and_an_ambiguous_rule(n: int) -> str:
    """n recursive rules with many paths per character that die on the next one (heavy
    early, slow to grow), and one ``(c0 | c1)+`` (light early, doubling): behind distinct
    prefixes, so each repetition is a start of its own."""
    return (
        "root ::= " + "".join(f'"{i}:" d{i} | ' for i in range(n)) + '"#" bad\n'
        + "".join(
            f"d{i} ::= (" + " | ".join(f'[a-z] "{i}-{j}"' for j in range(8)) + ")*\n"
            for i in range(n)
        )
        + "bad ::= (c0 | c1)+\nc0 ::= [a-z]\nc1 ::= [a-z]\n"
    )


@pytest.mark.parametrize("n", [0, 8, 20, 40])
def test_cheap_recursive_rules_do_not_crowd_out_an_ambiguous_one(n):
    """The pricing keeps the heaviest states of all starts together, and each start's
    own heaviest: the decoys are heavier for the first characters, the doubling wins."""
    assert "too ambiguous" in refused(decoys_and_an_ambiguous_rule(n))


# a generated grammar whose states (sets of distinct stacks) grow into the thousands
STATE_EXPLOSION = (
    'root ::= "\\n" .{2,2}* ()\na ::= "\\u00e9" (\n | b a\n | [^"\\\\]+ ( | x-1 | "\\""){0,3})'
    '\nb ::= "x" "\\u00e9"+ [\\]] ("\\""? ([a-z] | "ab" [-a]? "\\\\" | root [\\]]){2}{1,} '
    '("\\\\"{0,3}{0} [^"\\\\] | )) | "ab" !<[2]>{2,2} root\nx-1 ::= "\\x41" ("é" a |  | '
    '(){2,2} .? (a x-1 b | "é"{2,2} [^x]{ 1 , 2 } | "\\U0001F600"{0,3}{0}){0}){2,2} !<[2]> '
    '"é"{2} | "" ((b root\n | root b [^"\\\\]{ 1 , 2 }) |\n [^x] |\n ) "\\n"'
)


def test_the_pricing_stops_soon_after_its_budget():
    """Its own work is bounded: refused as too ambiguous to price within a small multiple
    of MAX_PRICING_WORK steps (each step a few dict or tuple operations)."""
    from wire import grammar_cost

    assert "too ambiguous to price" in refused(STATE_EXPLOSION)
    parser = gc._Parser(STATE_EXPLOSION)
    parser.parse()
    with pytest.raises(grammar_cost.PriceExceeded) as info:
        grammar_cost.price(parser.rules, parser.terms, parser.src, parser.symbols["root"],
                           gc.MAX_SAMPLING_VISITS, gc.MAX_PRICING_WORK)
    assert info.value.rule == -1 and info.value.work < 3 * gc.MAX_PRICING_WORK


def test_json_gbnf_and_schemas_price_well_inside_the_budget():
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    texts = [LLAMA_JSON_GBNF] + [json_schema_to_gbnf(json.dumps(s)) for s in TYPICAL_SCHEMAS]
    for text in texts:
        assert grammar_stats(text)["pricing_work"] < gc.MAX_PRICING_WORK / 4


# -- pricing from wherever the sampler stands (review of #31 deliverable 2) ----------------
# A bounded repetition ``item{12}`` is a chain of plain references, no recursive rule: the
# pricing also starts at every reference inside an alternative reachable from root, so one
# behind a long prefix, or behind decoy alternatives, is priced where the sampler stands.

SIXTEEN_ITEMS = (
    "item ::= " + " | ".join(f"c{i}" for i in range(16)) + "\n"
    + "".join(f"c{i} ::= [a-z ]\n" for i in range(16))
)


def behind_a_prefix(chars: int, reps: int = 12) -> str:
    return f'root ::= "{"a" * chars}" item{{{reps}}}\n' + SIXTEEN_ITEMS


def behind_decoys(n: int, reps: int = 12) -> str:
    """n literal alternatives next to ``"zzz" item{reps}``."""
    decoys = [f'"{chr(97 + i % 26) * 3}{i // 26 or ""}"' for i in range(n)]
    return "root ::= " + " | ".join(decoys) + f' | "zzz" item{{{reps}}}\n' + SIXTEEN_ITEMS


@pytest.mark.parametrize("chars", [0, 20])
def test_a_bounded_repetition_behind_a_short_prefix_is_refused(chars):
    assert "too ambiguous" in refused(behind_a_prefix(chars))


@pytest.mark.parametrize("chars,reps", [(33, 12), (40, 12), (100, 12), (40, 4), (40, 30)])
def test_a_bounded_repetition_behind_a_long_prefix_is_refused(chars, reps):
    assert "too ambiguous" in refused(behind_a_prefix(chars, reps))


@pytest.mark.parametrize("n", [16, 17])
def test_a_bounded_repetition_behind_decoys_is_refused(n):
    assert "too ambiguous" in refused(behind_decoys(n))


def test_a_bounded_repetition_in_a_rule_used_once_is_refused():
    text = f'root ::= "q" mid "r"\nmid ::= "{"a" * 40}" item{{12}}\n' + SIXTEEN_ITEMS
    assert "too ambiguous" in refused(text)


def test_a_bounded_repetition_behind_optional_groups_is_refused():
    text = f'root ::= "{"a" * 40}" "b"? ("c" "d"?)? item{{12}}\n' + SIXTEEN_ITEMS
    assert "too ambiguous" in refused(text)


def bounded_decoys_and_an_ambiguous_chain(n: int) -> str:
    """Behind a long prefix: n bounded repetitions of rules with many paths per character
    that die on the next one (heavy early), next to one doubling chain ``bad{40}``: each
    inner reference is a start of its own, kept through the pruning."""
    return (
        f'root ::= "{"a" * 40}" ('
        + "".join(f'"{i}:" d{i}{{6}} | ' for i in range(n)) + '"#" bad{40})\n'
        + "".join(
            f"d{i} ::= " + " | ".join(f'[a-z] "{i}-{j}"' for j in range(8)) + "\n"
            for i in range(n)
        )
        + "bad ::= c0 | c1\nc0 ::= [a-z]\nc1 ::= [a-z]\n"
    )


@pytest.mark.parametrize("n", [0, 20, 40])
def test_bounded_decoys_do_not_crowd_out_an_ambiguous_chain(n):
    assert "too ambiguous" in refused(bounded_decoys_and_an_ambiguous_chain(n))


def test_a_long_chain_of_equal_references_is_priced_once():
    """``char{1000}`` has 1000 inner references with the same next 33 elements: one start."""
    stats = grammar_stats('root ::= "x" c{1000}\nc ::= [a-z] | "\\\\" [nt]\n')
    assert stats["pricing_work"] < gc.MAX_PRICING_WORK / 8
