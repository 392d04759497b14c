"""What one grammar-constrained sampling call costs llama.cpp, bounded before it runs.

llama.cpp's grammar sampler (``llama_grammar_apply_impl`` in ``src/llama-grammar.cpp``)
checks every candidate token of the vocabulary against every parse stack, one character at
a time: ``llama_grammar_reject_candidates_for_stack`` matches the token's next character
against the stack's top, advances the stack (``llama_grammar_advance_stack``: a set of next
stacks) and recurses into each next stack with the candidates still alive. Equal stacks are
merged inside one advance, never across the branches of that recursion, so a token is
checked once per *path* of stacks, not once per distinct stack: an ambiguous repetition
(``item+`` with ``item ::= c0 | ... | c15``, every ``ck`` the same class) has k paths after
one character and k^n after n. A token the grammar rejects walks all of its paths; one it
accepts stops at the first path that takes it whole.

This module counts those paths. It rebuilds llama.cpp's stacks (positions in the flattened
rules, advanced the same way) and runs them over an abstract alphabet: the intervals of
code points that no terminal of the grammar tells apart, so one representative stands for
each interval. A state is the stacks alive after some string, each weighted by the number of
paths that reach it; states with the same stacks are merged keeping the larger weight of
each (an upper bound). ``C(n)`` is the most stack visits any string of at most ``n``
characters costs (the weights summed over its prefixes). It starts from ``root``, from
every recursive rule (where paths multiply without end; a sampler stands inside one after
any amount of output) and from every reference that is not the first element of an
alternative ``root`` reaches (a sampler stands there after a prefix of any length: a
bounded repetition ``item{12}`` is a chain of such references, no recursive rule). Such a
start is priced as its rule's frame alone (what lies below it only adds paths). A reference
that begins its alternative, or follows a nullable reference, needs no start of its own:
its stacks are among those of the reference to its rule, or of the reference before it;
references whose next ``MAX_TOKEN_CHARS + 1`` non-nullable elements are the same cost the
same and are priced once (``c{1000}``). All starts are priced together, up to
``MAX_TOKEN_CHARS`` characters, the longest token piece of the served vocabularies. After
each character the ``MAX_PRICING_STATES`` heaviest states are kept, and with them the
heaviest state of every start none of those came from, so cheap rules or decoy
alternatives cannot crowd an ambiguous one out.

States are interned (a set of stacks -> an id) and each state's moves (the next state per
character class, and which stacks feed which) are computed once: the same few hundred
states recur at every length and from every start, so following a move is a tuple
gather. The pricing's own work (stacks advanced, moves followed, weights carried) is
counted and bounded by the caller's budget.

The cost of one sampling call is then estimated as ``sum over n of N(n) * C(n)``, ``N`` being
how many tokens of the largest served vocabulary (Gemma 3's, 262,144 tokens) have ``n``
characters: visits of (stack, token) pairs, the unit of the sampler's work.
"""

from __future__ import annotations

import bisect
import operator
from typing import Any

# Strings are priced up to MAX_TOKEN_CHARS characters. PIECE_LENGTHS[n]: how many tokens
# have a piece of n characters, the larger count of the served vocabularies (counted from the
# GGUFs with llama_token_to_piece): Gemma 3, 262,144 tokens of at most 31 characters, and
# SmolLM2, 49,152 tokens of up to 81 (runs of "=", "-", spaces). A piece longer than
# MAX_TOKEN_CHARS is priced as C(MAX_TOKEN_CHARS) scaled by its length (linear
# extrapolation: 62 tokens of SmolLM2).
MAX_TOKEN_CHARS = 32
# States kept per string length while pricing (the heaviest): bounds the pricing's own time.
MAX_PRICING_STATES = 16
PIECE_LENGTHS = (
    0, 19483, 22111, 29689, 35963, 34914, 29539, 24360, 18943, 14189, 10292, 7814, 9579,
    2560, 1454, 753, 456, 32, 19, 9, 5, 6, 3, 3, 3, 8, 3, 3, 3, 3, 3, 3, 7, 2, 2, 2, 2, 2,
    1, 2, 2, 2, 2, 1, 2, 2, 2, 2, 3, 1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 4, 3, 1,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 1,
)
# (characters n, tokens of at least n characters): what C(n) is multiplied by, at least
_AT_LEAST = tuple(
    sum(PIECE_LENGTHS[n : MAX_TOKEN_CHARS + 1]) for n in range(MAX_TOKEN_CHARS + 2)
)
_LONG_WEIGHT = sum(
    count * length / MAX_TOKEN_CHARS
    for length, count in enumerate(PIECE_LENGTHS) if length > MAX_TOKEN_CHARS
)

_UNICODE_END = 0x110000
# a state's moves: (next state id, then either a getter of the next weights (each next stack
# has one source) or, per stack of the next state, the indices of its sources; the work of
# following it)
_Moves = tuple[tuple[int, Any, tuple[tuple[int, ...], ...] | None, int], ...]
_END, _REF, _CHAR, _DEAD = 0, 1, 2, 3  # element kinds (_DEAD: a token: matched by id only)


class PriceExceeded(Exception):
    """The grammar's estimated cost passes the limit (or cannot be priced within budget)."""

    def __init__(self, message: str, rule: int, work: int = 0) -> None:
        super().__init__(message)
        self.rule = rule
        self.work = work  # the pricing's steps when it stopped


_SIMPLE = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}
_HEX_SIZE = {"x": 2, "u": 4, "U": 8}


def _decode_char(text: str, pos: int) -> tuple[int, int]:
    """(code point, next position) of one character of a literal or class (parse_char);
    the text was validated by the parser."""
    c = text[pos]
    if c != "\\":
        return ord(c), pos + 1
    e = text[pos + 1]
    if e in _HEX_SIZE:
        size = _HEX_SIZE[e]
        return int(text[pos + 2 : pos + 2 + size], 16), pos + 2 + size
    return _SIMPLE[e], pos + 2


def _term_elements(kind: str, text: str) -> list[tuple[bool, tuple[tuple[int, int], ...]] | None]:
    """A terminal's llama.cpp elements: (negated, ranges) per character element, None for a
    token element. ``.`` is a negated empty class (any character)."""
    if kind == "dot":
        return [(True, ())]
    if kind == "tok":
        return [None]
    if kind == "lit":
        out: list[tuple[bool, tuple[tuple[int, int], ...]] | None] = []
        pos, end = 1, len(text) - 1
        while pos < end:
            cp, pos = _decode_char(text, pos)
            out.append((False, ((cp, cp),)))
        return out
    pos, end = 1, len(text) - 1
    negated = text[1] == "^"
    if negated:
        pos += 1
    ranges = []
    while pos < end:
        lo, pos = _decode_char(text, pos)
        hi = lo
        if text[pos] == "-" and pos + 1 < end:
            hi, pos = _decode_char(text, pos + 1)
        ranges.append((lo, hi))
    return [(negated, tuple(ranges))]


class _Machine:
    """llama.cpp's flattened rules: ``kind[pos]``/``arg[pos]`` per element, each alternative
    ending in an _END; ``alts[rule]`` the first position of each alternative."""

    def __init__(self, rules: list[list[list[int]]], terms: list[tuple[int, str, int, int]],
                 src: str) -> None:
        decoded = {}
        kind: list[int] = []
        arg: list[object] = []
        self.alts: list[list[int]] = []
        self.owner: list[int] = []  # position -> rule
        for rid, alternatives in enumerate(rules):
            starts = []
            for alt in alternatives:
                starts.append(len(kind))
                for item in alt:
                    if item >= 0:
                        kind.append(_REF)
                        arg.append(item)
                        continue
                    j = -item - 1
                    elements = decoded.get(j)
                    if elements is None:
                        _, k, start, end = terms[j]
                        elements = decoded[j] = _term_elements(k, src[start:end])
                    for el in elements:
                        kind.append(_DEAD if el is None else _CHAR)
                        arg.append(el)
                kind.append(_END)
                arg.append(None)
            self.owner.extend([rid] * (len(kind) - len(self.owner)))
            self.alts.append(starts)
        # the abstract alphabet: intervals that no character element splits
        cuts = {0, _UNICODE_END}
        for k, a in zip(kind, arg, strict=True):
            if k == _CHAR:
                for lo, hi in a[1]:  # type: ignore[index]
                    cuts.add(lo)
                    cuts.add(min(hi + 1, _UNICODE_END))
        bounds = sorted(cuts)
        self.n_classes = len(bounds) - 1
        full = (1 << self.n_classes) - 1
        masks: dict[object, int] = {}
        for pos, (k, a) in enumerate(zip(kind, arg, strict=True)):
            if k != _CHAR:
                continue
            mask = masks.get(a)
            if mask is None:
                mask = 0
                for lo, hi in a[1]:  # type: ignore[index]
                    if hi < lo:
                        continue
                    i = bisect.bisect_left(bounds, lo)
                    j = bisect.bisect_left(bounds, min(hi + 1, _UNICODE_END))
                    mask |= ((1 << j) - 1) ^ ((1 << i) - 1)
                if a[0]:  # type: ignore[index]
                    mask ^= full
                masks[a] = mask
            arg[pos] = mask
        self.kind = kind
        self.arg = arg
        self.full = full
        self._advanced: dict[tuple[int, ...], tuple[tuple[int, ...], ...]] = {}
        self._refs: dict[int, int] = {}
        # interned states: a set of stacks -> its id; per id its stacks (a fixed order) and,
        # once expanded, its moves (see ``moves``)
        self._ids: dict[frozenset, int] = {}
        self._stacks: list[tuple[tuple[int, ...], ...]] = []
        self._moves: list[_Moves | None] = []
        self.work = 0

    def ref_of(self, rule: int) -> int:
        """A position holding a lone reference to ``rule`` (added after the rules)."""
        pos = self._refs.get(rule)
        if pos is None:
            pos = self._refs[rule] = len(self.kind)
            self.kind += [_REF, _END]
            self.arg += [rule, None]
            self.owner += [rule, rule]
        return pos

    def advance(self, stack: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """``llama_grammar_advance_stack``: the stacks topped by a terminal (or empty)."""
        done = self._advanced.get(stack)
        if done is not None:
            return done
        kind, arg, alts = self.kind, self.arg, self.alts
        out: dict[tuple[int, ...], None] = {}
        seen = set()
        todo = [stack]
        while todo:
            cur = todo.pop()
            if cur in seen:
                continue
            seen.add(cur)
            self.work += 1 + len(cur)
            if not cur or kind[cur[-1]] != _REF:
                out[cur] = None
                continue
            pos = cur[-1]
            base = cur[:-1] if kind[pos + 1] == _END else cur[:-1] + (pos + 1,)
            for start in alts[arg[pos]]:  # type: ignore[index]
                todo.append(base if kind[start] == _END else base + (start,))
        result = tuple(out)
        self._advanced[stack] = result
        return result

    def after(self, stack: tuple[int, ...]) -> tuple[int, ...]:
        """The stack once its top character element has matched."""
        pos = stack[-1]
        return stack[:-1] if self.kind[pos + 1] == _END else stack[:-1] + (pos + 1,)

    def state(self, stacks: dict[tuple[int, ...], object]) -> int:
        """The id of the state made of ``stacks`` (interned: one id per set of stacks)."""
        key = frozenset(stacks)
        sid = self._ids.get(key)
        if sid is None:
            sid = self._ids[key] = len(self._stacks)
            self._stacks.append(tuple(stacks))
            self._moves.append(None)
        return sid

    def moves(self, sid: int, budget: int) -> _Moves:
        """Where state ``sid`` goes on each character (classes that no stack top tells
        apart are one move): per move the next state's id and, per stack of that state (in
        its order), the indices of this state's stacks whose paths lead there. Computed
        once per state: the same states recur at every length and from every start.
        Raises ``PriceExceeded`` (rule -1) once ``work`` passes ``budget``."""
        done = self._moves[sid]
        if done is not None:
            return done
        kind, arg = self.kind, self.arg
        stacks = self._stacks[sid]
        by_mask: dict[int, list[int]] = {}  # a top's class mask -> the stacks it tops
        for i, stack in enumerate(stacks):
            if stack and kind[stack[-1]] == _CHAR:
                by_mask.setdefault(arg[stack[-1]], []).append(i)  # type: ignore[arg-type]
        groups = [self.full]  # the alphabet cut where some top's class starts or ends
        for mask in by_mask:
            split = []
            for g in groups:
                inside, outside = g & mask, g & ~mask
                if inside:
                    split.append(inside)
                if outside:
                    split.append(outside)
            groups = split
        self.work += len(stacks) + len(groups) * (1 + len(by_mask))
        out = []
        for g in groups:
            new: dict[tuple[int, ...], list[int]] = {}
            for mask, members in by_mask.items():
                if not g & mask:
                    continue
                for i in members:
                    nexts = self.advance(self.after(stacks[i]))
                    self.work += len(nexts)
                    for s in nexts:
                        new.setdefault(s, []).append(i)
            if self.work > budget:
                raise PriceExceeded("", -1, self.work)
            if not new:
                continue
            nid = self.state(new)
            sources = [new[s] for s in self._stacks[nid]]
            if all(len(src) == 1 for src in sources):  # one path each: a permutation
                pick = operator.itemgetter(*(src[0] for src in sources), 0)
                out.append((nid, pick, None, len(sources)))
            else:
                out.append((nid, None, tuple(map(tuple, sources)), sum(map(len, sources))))
        result = tuple(out)
        self._moves[sid] = result
        return result


def _price_all(m: _Machine, starts: list[tuple[int, dict[tuple[int, ...], int]]],
               limit: int, budget: int) -> tuple[int, int]:
    """(the estimated visits of one sampling call, the start rule where it is worst) from
    every start at once (see the module docstring): a level holds the states reached after
    d characters from any start, a state reached from several starts (or strings) keeps the
    larger weight of each stack and the larger sum (an upper bound of each). Raises
    ``PriceExceeded`` (rule -1) when the pricing's own work passes ``budget``, and stops
    early with a cost above ``limit`` once it is certain."""
    level: dict[int, _Entry] = {}
    for i, (rule, start) in enumerate(starts):
        sid = m.state(start)
        weights = tuple([start[s] for s in m._stacks[sid]])
        _merge(level, sid, (weights, sum(weights), rule, 1 << i))
    top, top_rule = 0, starts[0][0]  # C(d): the most visits of a string of <= d characters
    cost = 0.0  # sum over n <= d of N(n) * C(n)
    for d in range(1, MAX_TOKEN_CHARS + 1):
        least = _AT_LEAST[d] + _LONG_WEIGHT  # tokens that cost at least C(d) each
        nxt: dict[int, _Entry] = {}
        for sid, (weights, cum, rule, origins) in level.items():
            if cum > top:
                top, top_rule = cum, rule
            get = weights.__getitem__
            for nid, pick, sources, work in m.moves(sid, budget):
                if pick is not None:
                    new = pick(weights)[:-1]
                else:
                    new = tuple([sum(map(get, src)) for src in sources])
                total = cum + sum(new)
                if total > top:
                    top, top_rule = total, rule
                    if cost + top * least > limit:  # certain already: every longer token
                        return int(cost + top * least), top_rule
                _merge(nxt, nid, (new, total, rule, origins))
                m.work += work
            if m.work > budget:
                raise PriceExceeded("", -1, m.work)
        if len(nxt) > MAX_PRICING_STATES:
            nxt = _heaviest(nxt)
        cost += PIECE_LENGTHS[d] * top
        bound = int(cost + (_AT_LEAST[d + 1] + _LONG_WEIGHT) * top)
        if bound > limit or not nxt:
            return bound, top_rule
        level = nxt
    return int(cost + _LONG_WEIGHT * top), top_rule


# a level's entry: the state's stacks' weights, the visits so far, the start rule of the
# heaviest string that reached it, the starts it was reached from (a bit per start)
_Entry = tuple[tuple[int, ...], int, int, int]


def _merge(level: dict[int, _Entry], sid: int, entry: _Entry) -> None:
    """Add state ``sid`` to ``level``, keeping the larger of each weight where it is there
    already (an upper bound of both strings)."""
    old = level.get(sid)
    if old is None:
        level[sid] = entry
    else:
        weights, cum, rule, origins = entry
        level[sid] = (tuple(map(max, weights, old[0])), max(cum, old[1]),
                      rule if cum > old[1] else old[2], origins | old[3])


def _heaviest(level: dict[int, _Entry]) -> dict[int, _Entry]:
    """The ``MAX_PRICING_STATES`` heaviest states (the most visits so far: where the paths
    multiply), and the heaviest of every start that none of those was reached from: one
    start's paths are never crowded out by other starts' (many cheap recursive rules
    cannot hide an ambiguous one)."""
    ranked = sorted(level.items(), key=lambda kv: kv[1][1], reverse=True)
    kept = dict(ranked[:MAX_PRICING_STATES])
    covered = 0
    for entry in kept.values():
        covered |= entry[3]
    for sid, entry in ranked[MAX_PRICING_STATES:]:
        if entry[3] & ~covered:
            kept[sid] = entry
            covered |= entry[3]
    return kept


def _recursive_rules(m: _Machine) -> list[int]:
    """Rules that can reach themselves through references (repetitions are such rules):
    paths only multiply without end around such a cycle (iterative Tarjan)."""
    n = len(m.alts)
    edges: list[list[int]] = [[] for _ in range(n)]
    for pos, k in enumerate(m.kind):
        if k == _REF:
            edges[m.owner[pos]].append(m.arg[pos])  # type: ignore[arg-type]
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    stack: list[int] = []
    out: list[int] = []
    counter = 0
    for root in range(n):
        if index[root] >= 0:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack[v] = True
            if i < len(edges[v]):
                work.append((v, i + 1))
                w = edges[v][i]
                if index[w] < 0:
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1 or v in edges[v]:
                    out.extend(component)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return sorted(out)


def _nullable_rules(m: _Machine) -> list[bool]:
    """Which rules can match the empty string (a fixpoint over the alternatives)."""
    nullable = [False] * len(m.alts)
    kind, arg = m.kind, m.arg
    changed = True
    while changed:
        changed = False
        for rid, starts in enumerate(m.alts):
            if nullable[rid]:
                continue
            for start in starts:
                pos = start
                while kind[pos] == _REF and nullable[arg[pos]]:  # type: ignore[index]
                    pos += 1
                m.work += 1 + pos - start
                if kind[pos] == _END:
                    nullable[rid] = changed = True
                    break
    return nullable


def _tail(m: _Machine, pos: int, nullable: list[bool]) -> tuple[object, ...]:
    """The elements from ``pos`` to the end of its alternative, cut after the
    ``MAX_TOKEN_CHARS + 1``-th that cannot match the empty string: no token reaches past
    it, so two positions with the same tail cost the same (a long chain ``char{1000}``
    is priced once, not once per position)."""
    kind, arg = m.kind, m.arg
    out: list[object] = []
    solid = 0
    while kind[pos] != _END and solid <= MAX_TOKEN_CHARS:
        out.append((kind[pos], arg[pos]))
        if kind[pos] != _REF or not nullable[arg[pos]]:  # type: ignore[index]
            solid += 1
        pos += 1
    m.work += len(out)
    return tuple(out)


def _inner_references(m: _Machine, root: int) -> list[int]:
    """The positions, in rules ``root`` reaches, of references that are not the first
    element of their alternative: where a sampler stands after any prefix (a bounded
    repetition ``item{12}`` is such a chain of references, no recursive rule, behind a
    prefix of any length). A reference that begins its alternative needs no start of its
    own: its paths are a subset of those from the reference to its rule in the caller
    (that reference's own start, or root's)."""
    n = len(m.alts)
    seen = [False] * n
    seen[root] = True
    todo = [root]
    out = []
    kind, arg = m.kind, m.arg
    while todo:
        rid = todo.pop()
        for start in m.alts[rid]:
            pos = start
            while kind[pos] != _END:
                if kind[pos] == _REF:
                    if pos != start:
                        out.append(pos)
                    target = arg[pos]
                    if not seen[target]:  # type: ignore[index]
                        seen[target] = True  # type: ignore[index]
                        todo.append(target)  # type: ignore[arg-type]
                pos += 1
        m.work += 1
    return sorted(out)


def price(rules: list[list[list[int]]], terms: list[tuple[int, str, int, int]], src: str,
          root: int, limit: int, budget: int) -> tuple[int, int, int]:
    """(estimated stack visits of one sampling call, the rule where it is worst, the
    pricing's own steps).

    Raises ``PriceExceeded`` once a start passes ``limit`` (its rule) or the pricing itself
    passes ``budget`` steps (rule -1)."""
    m = _Machine(rules, terms, src)
    starts: list[tuple[int, dict[tuple[int, ...], int]]] = []
    init: dict[tuple[int, ...], int] = {}
    for start in m.alts[root]:
        for s in m.advance(() if m.kind[start] == _END else (start,)):
            init[s] = 1
    starts.append((root, init))
    seen_sets = {frozenset(init)}
    for rid in _recursive_rules(m):
        stacks = m.advance((m.ref_of(rid),))
        key = frozenset(stacks)
        if key not in seen_sets:
            seen_sets.add(key)
            starts.append((rid, dict.fromkeys(stacks, 1)))
    nullable = _nullable_rules(m)
    seen_tails = set()
    for pos in _inner_references(m, root):
        if m.kind[pos - 1] == _REF and nullable[m.arg[pos - 1]]:  # type: ignore[index]
            continue  # its stacks are among those of the reference before it
        tail = _tail(m, pos, nullable)
        if tail in seen_tails:
            continue
        seen_tails.add(tail)
        stacks = m.advance((pos,))
        key = frozenset(stacks)
        if key not in seen_sets:
            seen_sets.add(key)
            starts.append((m.owner[pos], dict.fromkeys(stacks, 1)))
    cost, rule = _price_all(m, starts, limit, budget)
    if cost > limit:
        raise PriceExceeded("", rule, m.work)
    return cost, rule, m.work

