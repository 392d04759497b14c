"""A LoRA adapter file checked before llama.cpp's GGUF parser sees it (issue 35).

``llama_adapter_lora_init`` parses a GGUF file natively: a hostile or broken file must never
reach it. ``check_adapter(path, base)`` reads the file with bounded Python (every count,
length and offset checked against the file's size and fixed caps) and accepts only what
llama.cpp's LoRA loader expects of an adapter for ``base`` (``read_shapes`` of the base
model's file):

- GGUF version 3, at most ``MAX_KV`` metadata pairs and ``MAX_TENSORS`` tensors;
- ``general.type`` = ``adapter``, ``adapter.type`` = ``lora``, ``general.architecture`` the
  base's;
- every tensor a pair ``<base weight>.lora_a`` (ne = [in, rank]) and ``.lora_b`` (ne =
  [rank, out]) of a 2-D weight the base has with ne = [in, out], F32 or F16, 1 <= rank <=
  ``MAX_RANK``; no other tensor;
- every tensor's data inside the file, aligned, not overlapping another's.

Returns what it found (architecture, rank, the weights adapted, alpha); raises
``AdapterRefused`` (a ``ValueError``) naming the first problem.
"""

from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass
from typing import BinaryIO

MAGIC = b"GGUF"
MAX_FILE_BYTES = 2 << 30
MAX_KV = 4096
MAX_TENSORS = 65536
MAX_STRING = 1 << 20  # one metadata string or tensor name
MAX_ARRAY = 1 << 22  # elements of one metadata array (a vocabulary: 262,144)
MAX_RANK = 256
ALIGNMENT = 32  # GGUF's default (general.alignment may set another power of two)

# GGUF value types: (struct format, size) of the fixed-size ones
_FIXED = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
          6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_STRING, _ARRAY = 8, 9
_UINT32, _FLOAT32 = 4, 6
_TYPE_NAMES = {_STRING: "string", _FLOAT32: "float32", _UINT32: "uint32"}
_TYPED_KEYS = {"general.architecture": _STRING, "general.type": _STRING,
               "adapter.type": _STRING, "adapter.lora.alpha": _FLOAT32,
               "adapter.lora.task_name": _STRING, "adapter.lora.prompt_prefix": _STRING}
# the weights an adapter may adapt: a block's attention and feed-forward projections
_ADAPTABLE = re.compile(
    r"blk\.\d{1,4}\.(attn_q|attn_k|attn_v|attn_qkv|attn_output|ffn_up|ffn_down|ffn_gate)\.weight")
# tensor types an adapter may use: ggml type id -> bytes per element
_TENSOR_TYPES = {0: 4, 1: 2}  # F32, F16


class AdapterRefused(ValueError):
    """Not an adapter this service loads (the message says why)."""


@dataclass(frozen=True, slots=True)
class Adapter:
    architecture: str
    rank: int
    alpha: float | None
    weights: tuple[str, ...]  # the base weights it adapts


@dataclass(slots=True)
class _Gguf:
    metadata: dict[str, object]
    types: dict[str, int]  # each metadata key's GGUF type
    tensors: list[tuple[str, tuple[int, ...], int, int]]  # name, ne, type, offset
    data_start: int


def read_shapes(path: str | os.PathLike[str]) -> tuple[str, dict[str, tuple[int, ...]]]:
    """A base model file's architecture and its tensors' shapes (ne), read the same bounded
    way (the base is the operator's own file; its data is not read)."""
    with open(path, "rb") as f:
        g = _read(f, os.fstat(f.fileno()).st_size, check_data=False)
    arch = g.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise AdapterRefused("the base model names no architecture")
    return arch, {name: ne for name, ne, _t, _o in g.tensors}


def check_adapter(path: str | os.PathLike[str],
                  base: tuple[str, dict[str, tuple[int, ...]]]) -> Adapter:
    """Check an adapter file against its base model (``read_shapes``); see the module."""
    arch, shapes = base
    try:
        size = os.stat(path).st_size
    except OSError as e:
        raise AdapterRefused(f"cannot read the file: {e.strerror}") from None
    if size > MAX_FILE_BYTES:
        raise AdapterRefused(f"the file is larger than {MAX_FILE_BYTES} bytes")
    with open(path, "rb") as f:
        g = _read(f, size, check_data=True)
    meta = g.metadata
    # llama.cpp reads these keys with typed getters that abort the process on another type
    for key, kind in _TYPED_KEYS.items():
        if key in g.types and g.types[key] != kind:
            raise AdapterRefused(f"{key} is not a {_TYPE_NAMES[kind]}")
    if "adapter.alora.invocation_tokens" in g.types:
        raise AdapterRefused("an activated LoRA (adapter.alora.invocation_tokens) is not "
                             "supported")
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise AdapterRefused("not a LoRA adapter (general.type adapter, adapter.type lora)")
    if meta.get("general.architecture") != arch:
        raise AdapterRefused(f"an adapter for {meta.get('general.architecture')!r}, not for "
                             f"this model's {arch!r}")
    alpha = meta.get("adapter.lora.alpha")
    if alpha is not None and not (isinstance(alpha, float) and math.isfinite(alpha)
                                  and alpha > 0):
        raise AdapterRefused("adapter.lora.alpha is not a finite positive float32")
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, ne, _type, _offset in g.tensors:
        weight, _, part = name.rpartition(".")
        if part not in ("lora_a", "lora_b") or weight not in shapes:
            raise AdapterRefused(f"tensor {name!r} adapts no weight of the base model")
        if not _ADAPTABLE.fullmatch(weight):  # the embeddings (tied to the output on
            # Gemma: llama.cpp aborts on that pair), the output head, experts: refused
            raise AdapterRefused(f"tensor {name!r}: only a block's attention and feed-"
                                 "forward projections may be adapted")
        if part in pairs.setdefault(weight, {}):
            raise AdapterRefused(f"tensor {name!r} appears twice")
        pairs[weight][part] = ne
    if not pairs:
        raise AdapterRefused("the adapter has no tensors")
    ranks = set()
    for weight, parts in pairs.items():
        a, b, w = parts.get("lora_a"), parts.get("lora_b"), shapes[weight]
        if a is None or b is None:
            raise AdapterRefused(f"{weight!r} has only one of lora_a and lora_b")
        if len(w) != 2 or len(a) != 2 or len(b) != 2:
            raise AdapterRefused(f"{weight!r}: adapters apply to 2-D weights")
        if a[0] != w[0] or b[1] != w[1] or a[1] != b[0]:
            raise AdapterRefused(f"{weight!r}: lora_a {a} and lora_b {b} do not fit the "
                                 f"weight {w}")
        ranks.add(a[1])
    if len(ranks) != 1 or not 1 <= next(iter(ranks)) <= MAX_RANK:
        raise AdapterRefused(f"one rank of 1 to {MAX_RANK} for every tensor, not {sorted(ranks)}")
    return Adapter(arch, next(iter(ranks)), alpha, tuple(sorted(pairs)))


# -- the bounded reader --------------------------------------------------------------------


def _read(f: BinaryIO, size: int, check_data: bool) -> _Gguf:
    r = _Reader(f, size)
    if r.take(4) != MAGIC:
        raise AdapterRefused("not a GGUF file")
    if r.unpack("<I") != 3:
        raise AdapterRefused("not GGUF version 3")
    n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
    if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
        raise AdapterRefused("too many tensors or metadata entries")
    metadata: dict[str, object] = {}
    types: dict[str, int] = {}
    for _ in range(n_kv):
        key = r.string()
        if key in types:
            raise AdapterRefused(f"the metadata key {key!r} appears twice")
        types[key] = r.unpack("<I")
        metadata[key] = r.value(types[key], depth=0)
    if "general.alignment" in types and types["general.alignment"] != _UINT32:
        raise AdapterRefused("general.alignment is not a uint32")
    tensors = []
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.unpack("<I")
        if not 1 <= n_dims <= 4:
            raise AdapterRefused(f"tensor {name!r} has {n_dims} dimensions")
        ne = tuple(r.unpack("<Q") for _ in range(n_dims))
        kind, offset = r.unpack("<I"), r.unpack("<Q")
        tensors.append((name, ne, kind, offset))
    alignment = metadata.get("general.alignment", ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise AdapterRefused("general.alignment is not a power of two")
    data_start = -(-r.pos // alignment) * alignment
    if check_data:
        _check_data(tensors, data_start, alignment, size)
    return _Gguf(metadata, types, tensors, data_start)


def _check_data(tensors: list[tuple[str, tuple[int, ...], int, int]], data_start: int,
                alignment: int, size: int) -> None:
    spans = []
    for name, ne, kind, offset in tensors:
        if kind not in _TENSOR_TYPES:
            raise AdapterRefused(f"tensor {name!r}: type {kind} (F32 or F16 only)")
        count = 1
        for n in ne:
            if not 1 <= n <= 1 << 24:
                raise AdapterRefused(f"tensor {name!r}: a dimension of {n}")
            count *= n
        nbytes = count * _TENSOR_TYPES[kind]
        if offset % alignment or data_start + offset + nbytes > size:
            raise AdapterRefused(f"tensor {name!r}: its data lies outside the file")
        spans.append((offset, offset + nbytes, name))
    spans.sort()
    for (_s, end, name), (start, _e, other) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise AdapterRefused(f"tensors {name!r} and {other!r} overlap")


class _Reader:
    """Reads from a file, never past its size, never more than the caps allow."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.size, self.pos = f, size, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise AdapterRefused("the file ends too early")
        data = self.f.read(n)
        if len(data) != n:
            raise AdapterRefused("the file ends too early")
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise AdapterRefused("the file ends too early")
        self.f.seek(n, os.SEEK_CUR)
        self.pos += n

    def unpack(self, fmt: str) -> int:
        (value,) = struct.unpack(fmt, self.take(struct.calcsize(fmt)))
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > MAX_STRING:
            raise AdapterRefused("a string longer than the cap")
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise AdapterRefused("a string that is not UTF-8") from None

    def value(self, kind: int, depth: int) -> object:
        if kind in _FIXED:
            fmt, _ = _FIXED[kind]
            return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY and depth == 0:
            item, n = self.unpack("<I"), self.unpack("<Q")
            if n > MAX_ARRAY:
                raise AdapterRefused("a metadata array longer than the cap")
            if item in _FIXED:  # not kept: an adapter's checks read no array
                self.skip(n * _FIXED[item][1])
            elif item == _STRING:
                for _ in range(n):
                    length = self.unpack("<Q")
                    if length > MAX_STRING:
                        raise AdapterRefused("a string longer than the cap")
                    self.skip(length)
            else:
                raise AdapterRefused(f"a metadata array of type {item}")
            return None
        raise AdapterRefused(f"a metadata value of type {kind}")
