"""Bounds on tenants' GBNF grammars, checked before llama.cpp sees them.

JSON schemas have their own check, ``wire/schema_check.py``.

llama.cpp's grammar parser (``src/llama-grammar.cpp``) is recursive descent on the native
stack, trusts its input and expands repetitions eagerly, so a small hostile grammar can
kill the process that parses it (SIGSEGV on deep nesting, memory exhaustion on
``x{5,3}``) or stall it (exponential work while building the initial parse stacks). This
module re-implements that parser's syntax in pure Python, iteratively (no recursion, so it
cannot hit Python's recursion limit either) and in time linear in its bounded output, and
accepts a grammar only when it can show that llama.cpp parses it, with every count that
drives llama.cpp's work below a limit:

* the text is valid Unicode (no lone surrogates) without NUL, at most
  ``MAX_GRAMMAR_BYTES`` bytes of UTF-8;
* groups ``( ... )`` nest at most ``MAX_NESTING`` deep (llama.cpp recurses once per level);
* repetition counts ``{m,n}`` are at most ``MAX_REPETITION`` with m <= n (llama.cpp's own
  cap, 2000, turns a larger n into "unbounded" and m > n into an endless loop), and the
  expansion llama.cpp performs (``x{m,n}`` becomes m copies of x and n-m generated rules)
  stays under ``MAX_ELEMENTS`` grammar elements and ``MAX_RULES`` rules;
* every rule used is defined, a ``root`` rule exists, token references are numeric
  (``<[id]>``; ``<name>`` needs the model's vocabulary, which the web does not have);
* no rule is left-recursive, with emptiness followed through other rules (llama.cpp
  rejects direct left recursion but misses it through a rule that is only nullable
  indirectly, and then loops until memory runs out);
* llama.cpp's left-recursion scan (a depth-first walk without memoisation, recursive:
  exponential on some grammars) does at most ``MAX_LEFT_SCAN_WORK`` steps and recurses at
  most ``MAX_LEFT_DEPTH`` deep; the parse stacks that one advance fans out into (what
  ``llama_sampler_init_grammar`` builds for ``root``, and what each sampled character
  rebuilds from any position) number at most ``MAX_STACKS`` kept, ``MAX_ADVANCE_STATES``
  visited, and ``MAX_ADVANCE_WORK`` visited stacks times their length (upper bounds: the
  counts ignore llama.cpp merging equal stacks);
* one sampling call's estimated (stack, token) visits stay under ``MAX_SAMPLING_VISITS``
  (below).

Everything llama.cpp's parser rejects is rejected here as well (its error path prints the
grammar text to stderr, outside the daemon's log sink), so a grammar only reaches
llama.cpp when it parses there: checked by ``tests/scheduler/test_grammar_check.py``
(differential tests against llama.cpp in a subprocess) and by generated grammars fuzzed
against it (``bench/results/grammar_fuzz-2026-12-05.txt``: every accepted one parses in
llama.cpp without the process dying).
The checker is stricter in places (left recursion through nullable rules, ``<name>``
tokens, a reference to an undefined rule that ``x{0}`` deletes, repetition counts above
``MAX_REPETITION``).

Each limit below is set from a measurement of llama.cpp (what it survives, how its time
grows); docs/security.md, "Grammar limits and what sets them", has the table.

What the sampler does per token is priced too (``wire/grammar_cost.py``): llama.cpp checks
each vocabulary token against each *path* of parse stacks, character by character, and
equal stacks reached along different paths are not merged, so an ambiguous repetition
(issue 31: ``root ::= item+``, ``item ::= c0 | ... | c15``, each ``ck ::= [a-z ]``) costs
about 16^n per token of n characters and holds the daemon's loop in
``llama_sampler_apply`` for minutes. The pricing runs llama.cpp's stacks over the
grammar's character classes for strings of up to 32 characters (the longest token pieces)
from ``root``, from every recursive rule and from every reference inside an alternative
that ``root`` reaches (a bounded repetition ``item{12}`` is such a chain, behind a prefix of
any length), weights the worst string of each length by
how many tokens of that length the served vocabularies have, and refuses a grammar whose
estimate passes ``MAX_SAMPLING_VISITS`` (2 * 10^9 (stack, token) visits). The estimate is
an upper bound of the real work; the limit is calibrated against llama.cpp's grammar
sampler over the whole vocabulary (docs/security.md; its CPU per token on both models in
``bench/results/grammar_fuzz-2026-12-05.txt``).
The pricing itself stops at ``MAX_PRICING_WORK`` steps (refused as too ambiguous to price).

This module imports neither llama_cpp nor Django: the web calls it while parsing requests.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from . import grammar_cost
from .errors import InvalidParameter

# -- limits (docs/security.md says what sets each) ----------------------------------------

MAX_GRAMMAR_BYTES = 64 * 1024
MAX_NESTING = 512
MAX_REPETITION = 1000
MAX_RULES = 4096
MAX_ELEMENTS = 200_000
MAX_STACKS = 128
MAX_ADVANCE_STATES = 4096
MAX_ADVANCE_WORK = 250_000
MAX_LEFT_DEPTH = 1024
MAX_LEFT_SCAN_WORK = 1_000_000
MAX_TOKEN_ID = 2**31 - 1
MAX_SAMPLING_VISITS = 2 * 10**9  # estimated (stack, token) visits of one sampling call
MAX_PRICING_WORK = 500_000  # steps the pricing itself may take

# llama.cpp's own cap on repetition counts and on their products (MAX_REPETITION_THRESHOLD).
_LLAMA_REPETITION_THRESHOLD = 2000
_MAX_REPETITION_PRODUCT = min(MAX_REPETITION, _LLAMA_REPETITION_THRESHOLD)
# Saturation for the fan-out counts (they can grow exponentially with the rule count).
_CAP = 1 << 62

_SPACE = re.compile(r"(?:[ \t]|#[^\r\n\x00]*+)*+")
_SPACE_NL = re.compile(r"(?:[ \t\r\n]|#[^\r\n\x00]*+)*+")
_NAME = re.compile(r"[a-zA-Z0-9-]+")
_DIGITS = re.compile(r"[0-9]+")
_LITERAL_RUN = re.compile(r'[^"\\\x00]+')
_HEX = frozenset("0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = frozenset('trn\\"[]-')
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_DIGIT_SET = frozenset("0123456789")
# One item of a sequence and the space after it (parse_sequence's common cases; no
# backtracking: possessive and atomic groups). Anything else (groups, a newline or a
# comment inside {m,n}, malformed items) takes the character-level path below.
_ESCAPE = r"""\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[trn\\"\[\]-])"""
_CLASS_CHAR = rf"(?:[^\]\\\x00]|{_ESCAPE})"
_ITEM_BODY = (
    rf'(?P<lit>"(?:[^"\\\x00]|{_ESCAPE})*+")'
    rf"|(?P<cls>\[\^?(?>(?:{_CLASS_CHAR}(?:-(?!\]){_CLASS_CHAR})?)*)\])"
    r"|(?P<name>[a-zA-Z0-9-]+)"
    r"|(?P<tok>!?<\[[0-9]{1,10}\]>)"
    r"|(?P<dot>\.)"
    r"|(?P<rep>[*+?])"
    r"|(?P<bar>\|(?:[ \t\r\n]|#[^\r\n\x00]*+)*+)"
    r"|(?P<brace>\{[ \t]*(?P<lo>[0-9]+)[ \t]*(?:(?P<comma>,)[ \t]*(?P<hi>[0-9]*)[ \t]*)?\})"
)
_ITEM = re.compile(rf"(?:{_ITEM_BODY})(?:[ \t]|#[^\r\n\x00]*+)*+")
_ITEM_NL = re.compile(rf"(?:{_ITEM_BODY})(?:[ \t\r\n]|#[^\r\n\x00]*+)*+")
_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")


def _unicode_error(text: str, what: str) -> str | None:
    """Why ``text`` cannot go to C as UTF-8 (None: it can); ``what`` starts the message."""
    if "\x00" in text:
        return f"{what}contains a NUL character (position {text.index(chr(0))})"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"{what}is not valid Unicode (lone surrogate at position {exc.start})"
    return None


class _Frame:
    """One ``parse_alternates`` in progress: a rule body or a parenthesised group."""

    __slots__ = ("alts", "cur", "last", "n_prev", "n_before", "nested", "rule_id")

    def __init__(self, rule_id: int, nested: bool, n_before: int) -> None:
        self.rule_id = rule_id
        self.nested = nested
        self.n_before = n_before
        self.alts: list[list[int]] = []
        self.cur: list[int] = []
        self.last = 0  # llama.cpp's last_sym_start, as an index into cur
        self.n_prev = 1  # llama.cpp's n_prev_rules


class _GrammarError(Exception):
    def __init__(self, message: str, pos: int | None = None) -> None:
        super().__init__(message)
        self.pos = pos


class _Parser:
    """llama.cpp's GBNF grammar, parsed the way ``llama_grammar_parser::parse`` does.

    Rules are kept the way llama.cpp expands them: ``rules[id]`` is a list of alternatives,
    each a list of items; an item >= 0 references rule ``id``, an item < 0 is the terminal
    ``terms[-item - 1]``: a run of terminal elements (a literal string, a character class,
    a token, ``.``) as its element count and the span of its source text.
    """

    def __init__(self, text: str) -> None:
        self.src = text + "\x00"  # C's terminator: every lookahead below is in range
        self.symbols: dict[str, int] = {}
        self.names: list[str] = []  # rule id -> the user rule it belongs to
        self.rules: list[list[list[int]] | None] = []
        self.elements = 0
        # terminal item -(j + 1) -> (llama.cpp elements, kind, start, end of its source text)
        self.terms: list[tuple[int, str, int, int]] = []

    def _term(self, n: int, kind: str, start: int, end: int) -> int:
        self.terms.append((n, kind, start, end))
        return -len(self.terms)

    def weight(self, items: list[int]) -> int:
        """llama.cpp elements in a run of items (an upper bound: see the class docstring)."""
        terms = self.terms
        return sum(terms[-i - 1][0] if i < 0 else 1 for i in items)

    # symbols (llama_grammar_parser::get_symbol_id / generate_symbol_id)

    def _new_symbol(self, name: str) -> int:
        if len(self.names) >= MAX_RULES:
            raise _GrammarError(f"more than {MAX_RULES} rules (counting generated ones)")
        self.names.append(name)
        self.rules.append(None)
        return len(self.names) - 1

    def symbol(self, name: str) -> int:
        rid = self.symbols.get(name)
        if rid is None:
            rid = self.symbols[name] = self._new_symbol(name)
        return rid

    def _add_elements(self, n: int) -> None:
        self.elements += n
        if self.elements > MAX_ELEMENTS:
            raise _GrammarError(
                f"expands to more than {MAX_ELEMENTS} grammar elements "
                "(repetitions are expanded into copies)"
            )

    # lexing

    def space(self, pos: int, newline_ok: bool) -> int:
        return (_SPACE_NL if newline_ok else _SPACE).match(self.src, pos).end()

    def char(self, pos: int) -> int:
        """End of one character (``parse_char``)."""
        src = self.src
        c = src[pos]
        if c == "\\":
            e = src[pos + 1]
            if e in _HEX_ESCAPES:
                size = _HEX_ESCAPES[e]
                digits = src[pos + 2 : pos + 2 + size]
                if len(digits) != size or not all(d in _HEX for d in digits):
                    raise _GrammarError(f"expecting {size} hex digits after \\{e}", pos)
                return pos + 2 + size
            if e in _SIMPLE_ESCAPES:
                return pos + 2
            raise _GrammarError("unknown escape", pos)
        if c == "\x00":
            raise _GrammarError("unexpected end of input", pos)
        return pos + 1

    # parsing

    def parse(self) -> None:
        src = self.src
        pos = self.space(0, True)
        while src[pos] != "\x00":
            pos = self.rule(pos)
        self._add_elements(0)
        if not any(r is not None for r in self.rules):
            raise _GrammarError("has no rules")
        for name, rid in self.symbols.items():
            if self.rules[rid] is None:
                raise _GrammarError(f"rule '{_short(name)}' is used but not defined")
        if "root" not in self.symbols:
            raise _GrammarError("has no 'root' rule")

    def rule(self, pos: int) -> int:
        src = self.src
        m = _NAME.match(src, pos)
        if m is None:
            raise _GrammarError("expecting a rule name", pos)
        name = m.group()
        rule_id = self.symbol(name)
        pos = self.space(m.end(), False)
        if not src.startswith("::=", pos):
            raise _GrammarError("expecting ::=", pos)
        pos = self.space(pos + 3, True)
        pos = self.alternates(pos, name, rule_id)
        c = src[pos]
        if c == "\r":
            pos += 2 if src[pos + 1] == "\n" else 1
        elif c == "\n":
            pos += 1
        elif c != "\x00":
            raise _GrammarError("expecting newline or end", pos)
        return self.space(pos, True)

    def alternates(self, pos: int, name: str, rule_id: int) -> int:
        """A rule's body, groups included, with an explicit stack of open groups."""
        src = self.src
        symbols = self.symbols
        frames = [_Frame(rule_id, False, 0)]
        f = frames[0]
        item_re = _ITEM
        while True:
            m = item_re.match(src, pos)
            if m is not None:  # the common items, lexed by one regex (slow path below)
                kind = m.lastgroup
                if kind == "name":
                    item = symbols.get(m.group(kind))
                    if item is None:
                        item = self.symbol(m.group(kind))
                    f.last = len(f.cur)
                    f.n_prev = 1
                    f.cur.append(item)
                    self.elements += 1  # bounded by the input's size; checked at repeats
                elif kind == "lit" or kind == "cls":
                    # an upper bound on llama.cpp's elements: each takes >= 1 character
                    n = m.end(kind) - m.start(kind) - 2 - (src[pos + 1] == "^")
                    f.last = len(f.cur)
                    f.n_prev = 1
                    if n:  # "" and [] add nothing
                        f.cur.append(self._term(n, kind, m.start(kind), m.end(kind)))
                        self.elements += n
                elif kind == "bar":  # the next alternative
                    f.alts.append(f.cur)
                    f.cur, f.last, f.n_prev = [], 0, 1
                    self.elements += 1
                elif kind == "rep":
                    c = src[pos]
                    lo, hi = (0, None) if c == "*" else (1, None) if c == "+" else (0, 1)
                    self.repeat(f, name, lo, hi, pos)
                elif kind == "brace":
                    lo = self.count_digits(m.group("lo"), pos)
                    if m.group("comma") is None:
                        hi: int | None = lo
                    else:
                        hi = self.count_digits(m.group("hi"), pos) if m.group("hi") else None
                        if hi is not None and lo > hi:
                            raise _GrammarError(
                                f"repetition {{{lo},{hi}}}: minimum above maximum", pos
                            )
                    self.repeat(f, name, lo, hi, pos)
                else:
                    if kind == "tok":
                        digits = m.group(kind).rstrip("]>").rsplit("[", 1)[1]
                        if int(digits) > MAX_TOKEN_ID:
                            raise _GrammarError(f"token id above {MAX_TOKEN_ID}", pos)
                    f.last = len(f.cur)
                    f.n_prev = 1
                    f.cur.append(self._term(1, kind, m.start(kind), m.end(kind)))
                    self.elements += 1
                pos = m.end()
                continue
            c = src[pos]
            if c == '"':
                start = pos
                pos += 1
                n = 0
                while src[pos] != '"':
                    m = _LITERAL_RUN.match(src, pos)
                    if m is not None:
                        n += m.end() - pos
                        pos = m.end()
                    else:
                        pos = self.char(pos)
                        n += 1
                f.last = len(f.cur)
                f.n_prev = 1
                if n:
                    self._add_elements(n)
                    f.cur.append(self._term(n, "lit", start, pos + 1))
                pos = self.space(pos + 1, f.nested)
            elif c == "[":
                start = pos
                pos += 1
                if src[pos] == "^":
                    pos += 1
                n = 0
                while src[pos] != "]":
                    pos = self.char(pos)
                    n += 1
                    if src[pos] == "-" and src[pos + 1] != "]":
                        if src[pos + 1] == "\x00":
                            raise _GrammarError("unexpected end of input", pos)
                        pos = self.char(pos + 1)
                        n += 1
                f.last = len(f.cur)
                f.n_prev = 1
                if n:
                    self._add_elements(n)
                    f.cur.append(self._term(n, "cls", start, pos + 1))
                pos = self.space(pos + 1, f.nested)
            elif c == "<" or c == "!":
                start = pos
                pos = self.token(pos + 1 if c == "!" else pos)
                f.last = len(f.cur)
                f.n_prev = 1
                self._add_elements(1)
                f.cur.append(self._term(1, "tok", start, pos))
                pos = self.space(pos, f.nested)
            elif c in _WORD:
                m = _NAME.match(src, pos)
                ref = self.symbol(m.group())
                pos = self.space(m.end(), f.nested)
                f.last = len(f.cur)
                f.n_prev = 1
                self._add_elements(1)
                f.cur.append(ref)
            elif c == "(":
                if len(frames) > MAX_NESTING:
                    raise _GrammarError(f"nesting deeper than {MAX_NESTING} levels", pos)
                pos = self.space(pos + 1, True)
                n_before = len(self.names)
                f = _Frame(self._new_symbol(name), True, n_before)
                frames.append(f)
                item_re = _ITEM_NL
            elif c == ".":
                f.last = len(f.cur)
                f.n_prev = 1
                self._add_elements(1)
                f.cur.append(self._term(1, "dot", pos, pos + 1))
                pos = self.space(pos + 1, f.nested)
            elif c == "*" or c == "+" or c == "?":
                at = pos
                pos = self.space(pos + 1, f.nested)
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
                self.repeat(f, name, lo, hi, at)
            elif c == "{":
                at = pos
                pos = self.space(pos + 1, f.nested)
                lo, pos = self.count(pos)
                pos = self.space(pos, f.nested)
                if src[pos] == "}":
                    hi: int | None = lo
                    pos = self.space(pos + 1, f.nested)
                elif src[pos] == ",":
                    pos = self.space(pos + 1, f.nested)
                    hi = None
                    if src[pos] in _DIGIT_SET:
                        hi, pos = self.count(pos)
                        pos = self.space(pos, f.nested)
                    if src[pos] != "}":
                        raise _GrammarError("expecting '}'", pos)
                    pos = self.space(pos + 1, f.nested)
                else:
                    raise _GrammarError("expecting ',' or '}'", pos)
                if hi is not None and lo > hi:
                    raise _GrammarError(f"repetition {{{lo},{hi}}}: minimum above maximum", at)
                self.repeat(f, name, lo, hi, at)
            else:
                # end of a sequence (parse_sequence returns), then of the alternates
                if c == "|":
                    f.alts.append(f.cur)
                    f.cur, f.last, f.n_prev = [], 0, 1
                    self._add_elements(1)
                    pos = self.space(pos + 1, True)
                    continue
                f.alts.append(f.cur)
                self._add_elements(1)
                self.rules[f.rule_id] = f.alts
                if not f.nested:
                    return pos
                if c != ")":
                    raise _GrammarError("expecting ')'", pos)
                frames.pop()
                p = frames[-1]
                p.n_prev = max(1, len(self.names) - f.n_before)
                p.last = len(p.cur)
                self._add_elements(1)
                p.cur.append(f.rule_id)
                pos = self.space(pos + 1, p.nested)
                f = p
                item_re = _ITEM_NL if f.nested else _ITEM

    def token(self, pos: int) -> int:
        """``<[id]>`` (``parse_token``); ``<name>`` needs the vocabulary: refused."""
        src = self.src
        if src[pos] != "<":
            raise _GrammarError("expecting '<'", pos)
        if src[pos + 1] != "[":
            raise _GrammarError("token names (<name>) are not supported here; use <[id]>", pos)
        m = _DIGITS.match(src, pos + 2)
        if m is None:
            raise _GrammarError("expecting a token id", pos)
        if m.end() - m.start() > 10 or int(m.group()) > MAX_TOKEN_ID:
            raise _GrammarError(f"token id above {MAX_TOKEN_ID}", pos)
        end = m.end()
        if src[end] != "]" or src[end + 1] != ">":
            raise _GrammarError("expecting ']>'", end)
        return end + 2

    def count(self, pos: int) -> tuple[int, int]:
        m = _DIGITS.match(self.src, pos)
        if m is None:
            raise _GrammarError("expecting an integer", pos)
        return self.count_digits(m.group(), pos), m.end()

    @staticmethod
    def count_digits(digits: str, pos: int) -> int:
        if len(digits) > 6 or int(digits) > MAX_REPETITION:
            raise _GrammarError(f"repetition count above {MAX_REPETITION}", pos)
        return int(digits)

    def repeat(self, f: _Frame, name: str, lo: int, hi: int | None, at: int) -> None:
        """``handle_repetitions``: x{lo,hi} becomes lo copies of x and hi-lo new rules."""
        if f.last == len(f.cur):
            raise _GrammarError("expecting an item before */+/?/{", at)
        prev = f.cur[f.last :]
        total = hi if hi is not None and hi > 0 else (lo if lo > 0 else 1)
        if f.n_prev * total > _MAX_REPETITION_PRODUCT:
            raise _GrammarError(
                f"nested repetitions multiply to more than {MAX_REPETITION} copies", at
            )
        weight = self.weight(prev)
        n_opt = 1 if hi is None else hi - lo
        if len(self.names) + n_opt > MAX_RULES:
            raise _GrammarError(f"more than {MAX_RULES} rules (counting generated ones)", at)
        self._add_elements(max(lo - 1, 0) * weight + n_opt * (weight + 3) + 1)
        if lo == 0:
            del f.cur[f.last :]
        else:
            for _ in range(lo - 1):
                f.cur.extend(prev)
        last_rec = 0
        for i in range(n_opt):
            rec_id = self._new_symbol(name)
            alt = list(prev)
            if hi is None:
                alt.append(rec_id)
            elif i > 0:
                alt.append(last_rec)
            self.rules[rec_id] = [alt, []]
            last_rec = rec_id
        if n_opt > 0:
            f.cur.append(last_rec)
        f.n_prev *= total


def _short(name: str) -> str:
    return name if len(name) <= 40 else name[:40] + "..."


def _analyse(p: _Parser) -> dict[str, int]:
    """What llama.cpp does after parsing: left-recursion scan, then the initial stacks."""
    rules: list[list[list[int]]] = p.rules  # type: ignore[assignment]  # all defined now
    n = len(rules)

    # Nullable rules (a rule that can match the empty string), by the linear worklist.
    nullable = [False] * n
    remaining: list[int] = []  # per alternative: references not yet known nullable
    owner: list[int] = []
    users: list[list[int]] = [[] for _ in range(n)]  # rule -> alternatives that use it
    work: list[int] = []
    for rid, alts in enumerate(rules):
        for alt in alts:
            a = len(remaining)
            owner.append(rid)
            if alt and min(alt) < 0:  # holds a terminal
                remaining.append(-1)
                continue
            remaining.append(len(alt))
            for i in alt:
                users[i].append(a)
            if not alt and not nullable[rid]:
                nullable[rid] = True
                work.append(rid)
    while work:
        rid = work.pop()
        for a in users[rid]:
            remaining[a] -= 1
            if remaining[a] == 0 and not nullable[owner[a]]:
                nullable[owner[a]] = True
                work.append(owner[a])

    # The left-corner graph: A -> B when B can come first in A (after nullable items).
    edges: list[list[int]] = [[] for _ in range(n)]
    for rid, alts in enumerate(rules):
        for alt in alts:
            for i in alt:
                if i < 0:
                    break
                edges[rid].append(i)
                if not nullable[i]:
                    break

    # Iterative depth-first search: a cycle is left recursion; post-order for the counts.
    state = [0] * n  # 0 new, 1 on the path, 2 done
    order: list[int] = []
    for start in range(n):
        if state[start]:
            continue
        state[start] = 1
        path = [(start, 0)]
        while path:
            rid, k = path[-1]
            if k < len(edges[rid]):
                path[-1] = (rid, k + 1)
                nxt = edges[rid][k]
                if state[nxt] == 1:
                    raise _GrammarError(
                        f"rule '{_short(p.names[nxt])}' is left-recursive "
                        "(it can start with itself)"
                    )
                if state[nxt] == 0:
                    state[nxt] = 1
                    path.append((nxt, 0))
            else:
                path.pop()
                state[rid] = 2
                order.append(rid)

    # llama.cpp's left-recursion scan: one walk per unvisited rule, no memo within a walk.
    size = [sum(map(p.weight, alts)) + len(alts) for alts in rules]
    scan = [0] * n
    for rid in order:
        scan[rid] = min(_CAP, size[rid] + sum(scan[i] for i in edges[rid]))
    visited = [False] * n
    total = 0
    for rid in range(n):
        if visited[rid]:
            continue
        total = min(_CAP, total + scan[rid])
        if total > MAX_LEFT_SCAN_WORK:
            raise _GrammarError(
                f"too ambiguous: llama.cpp's left-recursion scan would take more than "
                f"{MAX_LEFT_SCAN_WORK} steps"
            )
        visited[rid] = True
        todo = [rid]
        while todo:
            for i in edges[todo.pop()]:
                if not visited[i]:
                    visited[i] = True
                    todo.append(i)

    # How deep llama.cpp's left-recursion scan recurses (native stack), and how long the
    # parse stacks built while advancing get.
    depth = [0] * n
    for rid in order:
        depth[rid] = 1 + max((depth[i] for i in edges[rid]), default=0)
        if depth[rid] > MAX_LEFT_DEPTH:
            raise _GrammarError(
                f"rule '{_short(p.names[rid])}' starts with a chain of more than "
                f"{MAX_LEFT_DEPTH} rules"
            )

    # Parse stacks (llama_grammar_advance_stack): advancing from a rule reference visits
    # t intermediate stacks, keeps f of them (those topped by a terminal) and falls
    # through z times (ways to match nothing). Upper bounds: equal stacks are merged.
    # g: how much longer the stacks get on the way (a reference that is not the last item
    # of its alternative leaves its continuation on the stack): llama.cpp copies each
    # stack it visits, so the work is about t * (1 + g).
    t_rule = [0] * n
    f_rule = [0] * n
    z_rule = [0] * n
    g_rule = [0] * n
    for rid in order:
        t_sum = f_sum = z_sum = g_max = 0
        for alt in rules[rid]:
            ways, t, f = 1, 0, 0
            last = len(alt) - 1
            for k, i in enumerate(alt):
                if i < 0:
                    t, f, ways = t + ways, f + ways, 0
                    break
                t = min(_CAP, t + ways * (1 + t_rule[i]))
                f = min(_CAP, f + ways * f_rule[i])
                ways = min(_CAP, ways * z_rule[i])
                g_max = max(g_max, (k < last) + g_rule[i])
                if not ways:
                    break
            t_sum = min(_CAP, t_sum + t)
            f_sum = min(_CAP, f_sum + f)
            z_sum = min(_CAP, z_sum + ways)
        t_rule[rid], f_rule[rid], z_rule[rid], g_rule[rid] = t_sum, f_sum, z_sum, g_max
    root = p.symbols["root"]
    worst_t, worst_f = t_rule[root] + z_rule[root], f_rule[root] + z_rule[root]
    worst_w = worst_t * (1 + g_rule[root])
    _check_fan_out(p, root, worst_t, worst_f, worst_w)
    # ... and from every position inside a rule: each accepted character advances one
    for rid, alts in enumerate(rules):
        for alt in alts:
            t, f, z, g = 0, 0, 1, 0
            not_last = False
            for i in reversed(alt):
                if i < 0:
                    t, f, z, g = 1, 1, 0, 0
                    not_last = True
                    continue
                zi = z_rule[i]
                t = 1 + t_rule[i] + zi * t
                f = f_rule[i] + zi * f
                if zi:
                    z = min(_CAP, zi * z)
                    g = max(g, not_last + g_rule[i])
                else:
                    z, g = 0, not_last + g_rule[i]
                not_last = True
                w = t * (1 + g)
                if t > worst_t or f > worst_f or w > worst_w:
                    _check_fan_out(p, rid, t, f, w)
                    worst_t, worst_f, worst_w = max(worst_t, t), max(worst_f, f), max(worst_w, w)
    try:
        visits, _, pricing_work = grammar_cost.price(
            rules, p.terms, p.src, root, MAX_SAMPLING_VISITS, MAX_PRICING_WORK
        )
    except grammar_cost.PriceExceeded as exc:
        if exc.rule < 0:
            raise _GrammarError(
                f"too ambiguous to price: pricing its sampling cost takes more than "
                f"{MAX_PRICING_WORK} steps"
            ) from None
        raise _GrammarError(
            f"too ambiguous: rule '{_short(p.names[exc.rule])}' matches the same text in so "
            f"many ways that one sampling step would check more than {MAX_SAMPLING_VISITS} "
            "(parse stack, token) pairs"
        ) from None
    return {
        "rules": n,
        "elements": p.elements,
        "sampling_visits": visits,
        "pricing_work": pricing_work,
        "left_scan": total,
        "left_depth": max(depth, default=0),
        "stacks": worst_f,
        "states": worst_t,
        "advance_work": worst_w,
    }


def _check_fan_out(p: _Parser, rid: int, states: int, stacks: int, work: int) -> None:
    if stacks > MAX_STACKS:
        raise _GrammarError(
            f"too ambiguous: rule '{_short(p.names[rid])}' can match more than "
            f"{MAX_STACKS} ways at once (parse stacks)"
        )
    if states > MAX_ADVANCE_STATES:
        raise _GrammarError(
            f"too ambiguous: rule '{_short(p.names[rid])}' expands into more than "
            f"{MAX_ADVANCE_STATES} partial parses"
        )
    if work > MAX_ADVANCE_WORK:
        raise _GrammarError(
            f"too deep: rule '{_short(p.names[rid])}' expands into partial parses that "
            f"take more than {MAX_ADVANCE_WORK} steps to build"
        )


def check_grammar(text: Any, field: str = "grammar") -> str:
    """``text`` if llama.cpp can parse it safely; raise ``InvalidParameter(field, ...)``."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidParameter(field, "must be a non-empty GBNF grammar string")
    if len(text) > MAX_GRAMMAR_BYTES:
        raise InvalidParameter(field, f"longer than {MAX_GRAMMAR_BYTES} bytes")
    problem = _unicode_error(text, "text ")
    if problem:
        raise InvalidParameter(field, problem)
    if len(text.encode("utf-8")) > MAX_GRAMMAR_BYTES:
        raise InvalidParameter(field, f"longer than {MAX_GRAMMAR_BYTES} bytes")
    problem = _verdict(text)
    if problem is not None:
        raise InvalidParameter(field, problem)
    return text


@functools.lru_cache(maxsize=32)
def _verdict(text: str) -> str | None:
    """Why llama.cpp cannot take ``text`` (None: it can). Cached: the daemon checks a
    grammar when it reads the request and again before it builds the sampler."""
    parser = _Parser(text)
    try:
        parser.parse()
        _analyse(parser)
    except _GrammarError as exc:
        message = str(exc)
        if exc.pos is not None:
            line = text.count("\n", 0, exc.pos) + 1
            column = exc.pos - (text.rfind("\n", 0, exc.pos) + 1) + 1
            message += f" (line {line}, column {column})"
        return message
    return None


def grammar_stats(text: str) -> dict[str, int]:
    """The counts the limits apply to, for a grammar ``check_grammar`` accepts (rules and
    elements after expansion, left-recursion scan steps and depth, worst fan-out)."""
    check_grammar(text)
    parser = _Parser(text)
    parser.parse()
    return _analyse(parser)
