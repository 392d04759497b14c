"""Ambiguous grammars against the pricing (wire/grammar_cost.py) and real daemons.

Generates grammars of the shapes that make llama.cpp's grammar sampler slow (alternatives
of overlapping classes under ``+``/``*``, nested repetition, literal alternatives sharing
prefixes, rules referencing each other, ambiguous repetitions behind cheap decoys, and JSON
schemas whose ``anyOf``/``oneOf`` overlap), then:

1. prices each with ``wire.grammar_check`` (verdict, estimated visits, CPU time of the check);
2. ``--sampler``: for each accepted grammar and each served model (Gemma 3 270M, SmolLM2),
   times llama.cpp's grammar sampler over the whole vocabulary for ``--tokens`` steps
   (random logits, the most likely allowed token accepted), in a child process killed
   after ``--hang-s`` (a grammar still inside one call then is a hang): worst and mean CPU
   per token, set against the estimate;
3. ``--live``: daphne and two real daemons (Gemma and SmolLM2): every grammar is sent to
   both through ``/v1/completions``; refused ones must be 400 ``invalid_request_error``
   naming the field and the limit, accepted ones must complete; afterwards each daemon's
   snapshot gives its worst loop turn (``loop.longest_turn_s``, fresh daemons) and its
   pid, which must be the one it started with.

Run (a Redis database of its own; the result goes to bench/results/):

    DJANGO_SETTINGS_MODULE=tests.settings TEST_REDIS_URL=redis://127.0.0.1:6379/11 \\
        .venv/bin/python bench/grammar_fuzz.py --n 120 --sampler --live \\
        --out bench/results/grammar_fuzz-$(date +%F).txt
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from wire import grammar_check  # noqa: E402
from wire.errors import InvalidParameter  # noqa: E402

CLASSES = ["[a-z]", "[a-z ]", "[a-m]", "[h-t]", "[a-zA-Z]", "[^\\n]", "[0-9a-f]", "[ -~]",
           "[aeiou]", "[a-z0-9]", "."]
WORDS = ["a", "ab", "abc", "abcd", "b", "ba", "the", "th", "then", "there", "x", "xy"]


# -- generators -----------------------------------------------------------------------------


def overlapping_alternatives(rng: random.Random) -> str:
    k = rng.randint(2, 12)
    rep = rng.choice("+*")
    return ("root ::= item" + rep + "\nitem ::= " + " | ".join(f"c{i}" for i in range(k))
            + "\n" + "".join(f"c{i} ::= {rng.choice(CLASSES)}\n" for i in range(k)))


def nested_repetition(rng: random.Random) -> str:
    inner = rng.choice(CLASSES)
    shape = rng.choice([
        "({x}+)+", "({x}*)+", "({x}+ {x}*)+", "({x}* {x}*)*", "(({x}+)+ \" \"?)+",
        "({x}{{1,3}})+", "({x}+ | {x}{x})+", "{x}* {x}* {x}* {x}*",
    ])
    return "root ::= " + shape.format(x=inner) + "\n"


def shared_prefixes(rng: random.Random) -> str:
    words = rng.sample(WORDS, rng.randint(3, 8))
    alts = " | ".join(f'"{w}"' for w in words)
    return f"root ::= ({alts}){rng.choice('+*')}\n"


def mutual_rules(rng: random.Random) -> str:
    a, b = rng.choice(CLASSES), rng.choice(CLASSES)
    return rng.choice([
        f"root ::= x+\nx ::= y z | z y | y\ny ::= {a} | {a} y\nz ::= {b}\n",
        f"root ::= s\ns ::= t s | t\nt ::= u | v\nu ::= {a}\nv ::= {b} | {a}\n",
        f"root ::= (p | q)+\np ::= {a} q?\nq ::= {b} p?\n",
        f'root ::= e\ne ::= e2 ("+" e2)*\ne2 ::= {a}+ | "(" e ")" | {b}+\n',
    ])


def decoys(rng: random.Random) -> str:
    n, k = rng.randint(4, 30), rng.randint(2, 4)
    return ("root ::= " + "".join(f'"{i}:" d{i} | ' for i in range(n)) + '"#" bad\n'
            + "".join(f"d{i} ::= (" + " | ".join(f'[a-z] "{i}-{j}"' for j in range(6))
                      + ")*\n" for i in range(n))
            + "bad ::= (" + " | ".join(f"c{j}" for j in range(k)) + ")+\n"
            + "".join(f"c{j} ::= {rng.choice(CLASSES[:4])}\n" for j in range(k)))


def schema_overlap(rng: random.Random) -> dict:
    k = rng.randint(2, 8)
    word = {"type": "string"}
    branches = [rng.choice([
        word, {"type": "string", "pattern": f"^[a-z]{{1,{rng.randint(3, 20)}}}$"},
        {"type": "string", "maxLength": rng.randint(2, 30)},
        {"type": "string", "enum": rng.sample(WORDS, 3)},
        {"type": "integer"}, {"type": "number"},
    ]) for _ in range(k)]
    key = rng.choice(["anyOf", "oneOf"])
    item = {key: branches}
    return rng.choice([
        {"type": "array", "items": item},
        {"type": "object", "properties": {"v": item, "w": {"type": "array", "items": item}}},
        item,
    ])


def ladder() -> list[dict]:
    """Grammars whose estimates climb through the limit (priced without it), for the
    calibration: estimate against the sampler's real time per token."""
    out = []
    for m in range(1, 9):
        out.append(("stars", "root ::= " + " ".join(["[a-z ]*"] * m) + "\n"))
    for k in (2, 3, 4):
        out.append(("alternatives", "root ::= item+\nitem ::= " + " | ".join(
            f"c{i}" for i in range(k)) + "\n" + "".join(f"c{i} ::= [a-z ]\n" for i in range(k))))
    for d in (2, 3, 4):
        out.append(("nested", "root ::= " + "(" * d + "[a-z ]+" + ")+" * d + "\n"))
    return [{"family": "ladder-" + f, "field": "grammar", "value": g, "ladder": True}
            for f, g in out]


GENERATORS = [overlapping_alternatives, nested_repetition, shared_prefixes, mutual_rules,
              decoys]


def generate(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        if i % 6 == 5:
            cases.append({"family": "schema_overlap", "field": "json_schema",
                          "value": schema_overlap(rng)})
        else:
            gen = GENERATORS[i % 6 % len(GENERATORS)]
            cases.append({"family": gen.__name__, "field": "grammar", "value": gen(rng)})
    return cases


# -- 1. the pricing -------------------------------------------------------------------------


def gbnf_of(case: dict) -> str:
    if case["field"] == "grammar":
        return case["value"]
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    return json_schema_to_gbnf(grammar_check.check_json_schema(case["value"]))


def price(case: dict) -> None:
    gbnf = gbnf_of(case)
    case["gbnf"] = gbnf
    grammar_check._verdict.cache_clear()
    t0 = time.process_time()
    try:
        grammar_check.check_grammar(gbnf, case["field"])
        case["accepted"] = True
    except InvalidParameter as exc:
        case["accepted"], case["why"] = False, exc.message
    case["check_ms"] = (time.process_time() - t0) * 1000
    if case["accepted"]:
        case["visits"] = grammar_check.grammar_stats(gbnf)["sampling_visits"]
    elif case.get("ladder"):  # priced without the limit
        from wire import grammar_cost

        p = grammar_check._Parser(gbnf)
        p.parse()
        try:
            case["visits"] = grammar_cost.price(p.rules, p.terms, p.src, p.symbols["root"],
                                                10**30, 10**7)[0]
        except grammar_cost.PriceExceeded:
            case["visits"] = float("inf")


# -- 2. the sampler, timed in a child ---------------------------------------------------------


def sampler_child(model_path: str, tokens: int) -> None:
    """Reads one GBNF per line (JSON) on stdin, answers one JSON line each."""
    import ctypes

    import llama_cpp as lc
    import numpy as np

    quiet = lc.llama_log_callback(lambda *a: None)  # referenced while C may call it
    lc.llama_log_set(quiet, ctypes.c_void_p(0))
    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(model_path.encode(), params)
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    dtype = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
    cand = np.zeros(n_vocab, dtype)
    rng = np.random.default_rng(7)
    print(json.dumps({"ready": n_vocab}), flush=True)
    for line in sys.stdin:
        gbnf = json.loads(line)
        sampler = lc.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
        times = []
        for _ in range(tokens):
            cand["id"] = np.arange(n_vocab, dtype=np.int32)
            cand["logit"] = rng.standard_normal(n_vocab).astype(np.float32)
            arr = lc.llama_token_data_array(data=cand.ctypes.data_as(lc.llama_token_data_p),
                                            size=n_vocab, selected=-1, sorted=False)
            t0 = time.thread_time()
            lc.llama_sampler_apply(sampler, ctypes.byref(arr))
            times.append(time.thread_time() - t0)
            logits = cand["logit"]
            finite = np.isfinite(logits)
            finite[lc.llama_vocab_eos(vocab)] = False  # keep generating
            if not finite.any():
                break
            token = int(np.argmax(np.where(finite, logits, -np.inf)))
            lc.llama_sampler_accept(sampler, token)
        lc.llama_sampler_free(sampler)
        print(json.dumps({"max_ms": max(times) * 1000, "mean_ms": statistics.fmean(times) * 1000,
                          "steps": len(times)}), flush=True)


def time_samplers(cases: list[dict], model: str, path: str, tokens: int, hang_s: float) -> None:
    todo = [c for c in cases if c["accepted"] or c.get("ladder")]
    while todo:
        child = subprocess.Popen([sys.executable, __file__, "--sampler-child", path,
                                  "--tokens", str(tokens)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        json.loads(child.stdout.readline())
        while todo:
            case = todo[0]
            child.stdin.write(json.dumps(case["gbnf"]) + "\n")
            child.stdin.flush()
            answer = _readline(child, hang_s)
            todo.pop(0)
            if answer is None:  # inside one native call past hang_s: a hang
                case.setdefault("sampler", {})[model] = {"hang": hang_s}
                child.kill()
                child.wait()
                break
            case.setdefault("sampler", {})[model] = json.loads(answer)
        else:
            child.stdin.close()
            child.wait()


def _readline(child: subprocess.Popen, timeout_s: float) -> str | None:
    import select

    ready, _, _ = select.select([child.stdout], [], [], timeout_s)
    return child.stdout.readline() if ready else None


# -- 3. live: daphne and two daemons ----------------------------------------------------------


def live(cases: list[dict], max_tokens: int) -> dict:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from config.models import CATALOG, SMOLLM2
    from tests.live_service import RealDaemon, WebServer

    web = WebServer().start()
    daemons = {}
    try:
        daemons["gemma"] = RealDaemon(web, "gemma-grammar-fuzz").start()
        daemons["smollm2"] = RealDaemon(web, SMOLLM2,
                                        MODEL_PATH=str(CATALOG[SMOLLM2].path())).start()
        pids = {name: d.snapshot()["pid"] for name, d in daemons.items()}
        out = {"bad": []}
        for case in cases:
            for name, daemon in daemons.items():
                body = {"model": daemon.model, "prompt": "Some text:", "max_tokens": max_tokens,
                        "temperature": 1.0, "seed": 1, case["field"]: case["value"]}
                t0 = time.monotonic()
                reply = web.request("POST", "/v1/completions", body, key=web.keys["owner"],
                                    timeout=300)
                answer = reply.json()
                wall = time.monotonic() - t0
                case.setdefault("live", {})[name] = {"status": reply.status, "s": wall}
                ok = (reply.status == 200) if case["accepted"] else (
                    reply.status == 400
                    and answer["error"]["code"] == "invalid_request_error"
                    and answer["error"]["param"] in (case["field"], "response_format"))
                if not ok:
                    out["bad"].append((case["family"], name, reply.status, str(answer)[:300]))
        for name, daemon in daemons.items():
            snap = daemon.snapshot()
            out[name] = {"longest_turn_s": snap["loop"]["longest_turn_s"],
                         "pid_same": snap.get("pid") == pids[name]
                         and daemon.proc.poll() is None}
        return out
    finally:
        for daemon in daemons.values():
            daemon.stop()
        web.stop()


# -- the report ---------------------------------------------------------------------------------


def report(cases: list[dict], args: argparse.Namespace, live_out: dict | None) -> str:
    lines = [f"# bench/grammar_fuzz.py, {time.strftime('%Y-%m-%d %H:%M')}",
             f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average "
             f"{os.getloadavg()[0]:.1f} at the end; python {platform.python_version()}",
             "command: " + " ".join(sys.argv),
             f"limit MAX_SAMPLING_VISITS {grammar_check.MAX_SAMPLING_VISITS:.1e}, "
             f"MAX_PRICING_WORK {grammar_check.MAX_PRICING_WORK}", ""]
    fams: dict[str, list[dict]] = {}
    for c in cases:
        fams.setdefault(c["family"], []).append(c)
    lines.append("family               tried refused  check ms (median / max)")
    for fam, cs in fams.items():
        refused = sum(not c["accepted"] for c in cs)
        ms = [c["check_ms"] for c in cs]
        lines.append(f"{fam:20s} {len(cs):5d} {refused:7d}  {statistics.median(ms):7.1f} / "
                     f"{max(ms):7.1f}")
    total_refused = sum(not c["accepted"] for c in cases)
    lines.append(f"all                  {len(cases):5d} {total_refused:7d}  refused share "
                 f"{total_refused / len(cases):.2f}")
    if args.sampler:
        lines += ["", f"sampler CPU per token, whole vocabulary, {args.tokens} steps each "
                      "(accepted grammars):",
                  "model     worst ms  (grammar's estimate)   hangs   ns per estimated visit "
                  "(worst token / estimate, median, max)"]
        for model in ("gemma", "smollm2"):
            rows = [(c["sampler"][model], c) for c in cases
                    if c["accepted"] and model in c.get("sampler", {})]  # ladder's too
            hangs = sum("hang" in r for r, _ in rows)
            timed = [(r["max_ms"], c) for r, c in rows if "hang" not in r]
            if not timed:
                continue
            worst, wc = max(timed, key=lambda x: x[0])
            ratios = [ms * 1e6 / c["visits"] for ms, c in timed if c["visits"]]
            lines.append(f"{model:8s} {worst:9.1f}  ({wc['visits']:.2e}, {wc['family']})  "
                         f"{hangs:5d}   {statistics.median(ratios):.3f}, {max(ratios):.3f}")
        lines += ["", "calibration ladder (priced without the limit): estimate -> worst ms per "
                      "token (gemma, smollm2); hang = still inside one call after --hang-s"]
        for c in (c for c in cases if c.get("ladder")):
            s = c.get("sampler", {})
            lines.append(f"  {c['visits']:.2e}  {'accepted' if c['accepted'] else 'refused '} "
                         + ", ".join(_ms(s.get(m)) for m in ("gemma", "smollm2"))
                         + "   " + c["gbnf"].replace("\n", " | ")[:70])
        near = sorted((c for c in cases if c["accepted"] and not c.get("ladder")),
                      key=lambda c: -c["visits"])[:8]
        lines += ["", "the most expensive accepted grammars: estimate -> worst ms per token "
                      "(gemma, smollm2)"]
        for c in near:
            s = c.get("sampler", {})
            lines.append(f"  {c['visits']:.2e}  {c['family']:20s} "
                         + ", ".join(f"{s[m].get('max_ms', float('nan')):.1f}" if m in s
                                     else "-" for m in ("gemma", "smollm2"))
                         + "   " + c["gbnf"].replace("\n", " | ")[:90])
    if live_out is not None:
        lines += ["", f"live (daphne + fresh daemons, max_tokens {args.max_tokens}, every "
                      "grammar sent to both):"]
        for name in ("gemma", "smollm2"):
            d = live_out[name]
            lines.append(f"  {name}: worst loop turn {d['longest_turn_s']:.3f} s, same pid "
                         f"and alive: {d['pid_same']}")
        walls = [v["s"] for c in cases for v in c.get("live", {}).values()]
        lines.append(f"  requests {len(walls)}, slowest answer {max(walls):.2f} s; "
                     f"unexpected answers: {len(live_out['bad'])}")
        for bad in live_out["bad"][:10]:
            lines.append(f"    {bad}")
    return "\n".join(lines) + "\n"


def _ms(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"hang>{r['hang']:.0f}s" if "hang" in r else f"{r['max_ms']:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=120)
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--sampler", action="store_true")
    ap.add_argument("--live", action="store_true")
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--hang-s", type=float, default=60)
    ap.add_argument("--out")
    ap.add_argument("--sampler-child")
    args = ap.parse_args()
    if args.sampler_child:
        sampler_child(args.sampler_child, args.tokens)
        return
    cases = generate(args.n, args.seed) + (ladder() if args.sampler else [])
    for case in cases:
        price(case)
    if args.sampler:
        from config.models import CATALOG, GEMMA, SMOLLM2

        for model, name in (("gemma", GEMMA), ("smollm2", SMOLLM2)):
            time_samplers(cases, model, str(CATALOG[name].path()), args.tokens, args.hang_s)
    live_out = live(cases, args.max_tokens) if args.live else None
    text = report(cases, args, live_out)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
