"""Bounds on tenants' JSON schemas, checked before ``json_schema_to_gbnf`` runs.

That converter (llama_cpp's) turns ``maxLength: n`` into n nested groups and
``minItems: n`` into n copies, so a small schema can become a huge grammar. This module
bounds a schema's nesting depth, serialized size, node and property counts, the repetition
keywords and pattern quantifiers, and the magnitude of numeric bounds. The GBNF the
converter produces goes through ``wire.grammar_check.check_grammar`` as well
(``engine.grammar_for``): the converter can still emit a large grammar, or one llama.cpp
refuses (a pattern's ``\\.`` is copied as an unknown escape).

Each limit below is set from a measurement of the converter; docs/security.md, "Grammar
limits and what sets them", has the table.

This module imports neither llama_cpp nor Django: the web calls it while parsing requests.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from .errors import InvalidParameter
from .grammar_check import _unicode_error

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_NODES = 10_000
MAX_SCHEMA_PROPERTIES = 128
MAX_SCHEMA_COUNT = 1000  # minLength/minItems/... and a pattern's {m}: copies in the grammar
MAX_SCHEMA_OPTIONAL = 256  # max - min (maxLength alone, {m,n}): nested groups in the grammar
MAX_SCHEMA_NUMBER = 10**18  # |minimum|, |maximum|, ...: at most 18 digits
MAX_PATTERN_NESTING = 32

# keyword -> its counterpart: max - min nested groups, min copies (json_schema_to_gbnf)
_COUNT_PAIRS = {
    "minLength": "maxLength",
    "minItems": "maxItems",
    "minProperties": "maxProperties",
    "minContains": "maxContains",
}
_COUNT_KEYWORDS = frozenset(_COUNT_PAIRS) | frozenset(_COUNT_PAIRS.values())
_NUMBER_KEYWORDS = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
)
# keywords whose value maps names to schemas, and those whose value is plain data
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required"})
_SCHEMA, _MAP, _DATA = 0, 1, 2
_QUANTIFIER = re.compile(r"\{\s*([0-9]*)\s*(,\s*([0-9]*)\s*)?\}")


def _check_pattern(field: str, pattern: str) -> None:
    """Group nesting and {m,n} counts of a regex that the converter turns into GBNF."""
    depth = 0
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i += 1
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
        elif c == "(":
            depth += 1
            if depth > MAX_PATTERN_NESTING:
                raise InvalidParameter(
                    field, f"pattern: groups nested deeper than {MAX_PATTERN_NESTING} levels"
                )
        elif c == ")":
            depth -= 1
        elif c == "{":
            m = _QUANTIFIER.match(pattern, i)
            if m is not None:
                lo = _pattern_count(field, m.group(1)) or 0
                hi = lo if m.group(2) is None else _pattern_count(field, m.group(3))
                if hi is not None and lo > hi:
                    raise InvalidParameter(field, f"pattern: quantifier {m.group()} has min > max")
                if hi is not None and hi - lo > MAX_SCHEMA_OPTIONAL:
                    raise InvalidParameter(
                        field,
                        f"pattern: quantifier {m.group()} allows more than "
                        f"{MAX_SCHEMA_OPTIONAL} optional repetitions",
                    )
                i = m.end()
                continue
        i += 1


def _pattern_count(field: str, digits: str) -> int | None:
    """A quantifier's count (None: absent, as in {2,})."""
    if not digits:
        return None
    if len(digits) > 6 or int(digits) > MAX_SCHEMA_COUNT:
        raise InvalidParameter(field, f"pattern: quantifier count above {MAX_SCHEMA_COUNT}")
    return int(digits)


def _check_counts(field: str, schema: Mapping[str, Any]) -> None:
    for key in _COUNT_KEYWORDS & schema.keys():
        value = schema[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidParameter(field, f"{key} must be a non-negative integer")
        if value > MAX_SCHEMA_COUNT:
            raise InvalidParameter(field, f"{key} above {MAX_SCHEMA_COUNT}")
    for low_key, high_key in _COUNT_PAIRS.items():
        low, high = schema.get(low_key, 0), schema.get(high_key)
        if high is None:
            continue
        if low > high:
            raise InvalidParameter(field, f"{low_key} is greater than {high_key}")
        if high - low > MAX_SCHEMA_OPTIONAL:
            raise InvalidParameter(
                field,
                f"{high_key} - {low_key} above {MAX_SCHEMA_OPTIONAL} "
                "(each optional repetition nests a group in the grammar)",
            )
    for key in _NUMBER_KEYWORDS & schema.keys():
        value = schema[key]
        if isinstance(value, bool) and key.startswith("exclusive"):
            continue  # draft 4's boolean form
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidParameter(field, f"{key} must be a number")
        finite = not isinstance(value, float) or math.isfinite(value)
        if not finite or abs(value) > MAX_SCHEMA_NUMBER:
            raise InvalidParameter(field, f"{key} must be a finite number of at most 18 digits")
    pattern = schema.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise InvalidParameter(field, "pattern must be a string")
        _check_pattern(field, pattern)
    properties = schema.get("properties")
    if isinstance(properties, Mapping) and len(properties) > MAX_SCHEMA_PROPERTIES:
        raise InvalidParameter(
            field, f"an object schema with more than {MAX_SCHEMA_PROPERTIES} properties"
        )


def check_json_schema(schema: Any, field: str = "json_schema") -> str:
    """The schema as canonical JSON text (sorted keys) if it is within bounds; raise
    ``InvalidParameter(field, ...)`` otherwise. Walks the value iteratively."""
    if not isinstance(schema, Mapping):
        raise InvalidParameter(field, "must be a JSON object (a JSON Schema)")
    nodes = 0
    todo: list[tuple[Any, int, int]] = [(schema, 1, _SCHEMA)]
    while todo:
        node, depth, kind = todo.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise InvalidParameter(field, f"more than {MAX_SCHEMA_NODES} values")
        if isinstance(node, str):
            problem = _unicode_error(node, "a string ")
            if problem:
                raise InvalidParameter(field, problem)
            continue
        if isinstance(node, (bool, int)) or node is None:
            continue
        if isinstance(node, float):
            if not math.isfinite(node):
                raise InvalidParameter(field, "numbers must be finite")
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidParameter(field, f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, Mapping):
            if kind == _SCHEMA:
                _check_counts(field, node)
            for key, value in node.items():
                if not isinstance(key, str):
                    raise InvalidParameter(field, "object keys must be strings")
                problem = _unicode_error(key, "a key ")
                if problem:
                    raise InvalidParameter(field, problem)
                if kind == _DATA:
                    child = _DATA
                elif kind == _MAP:
                    child = _SCHEMA
                elif key in _SCHEMA_MAPS:
                    child = _MAP
                elif key in _DATA_KEYWORDS:
                    child = _DATA
                else:
                    child = _SCHEMA
                todo.append((value, depth + 1, child))
        elif isinstance(node, (list, tuple)):
            for value in node:
                todo.append((value, depth + 1, kind))
        else:
            raise InvalidParameter(field, f"holds a {type(node).__name__}, not JSON")
    text = json.dumps(schema, sort_keys=True)
    if len(text) > MAX_SCHEMA_BYTES:
        raise InvalidParameter(field, f"longer than {MAX_SCHEMA_BYTES} bytes as JSON")
    return text
