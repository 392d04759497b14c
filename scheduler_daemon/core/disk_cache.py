"""Level 3 of the prefix cache: saved sequence states as files, LRU under a byte budget.

A file is one sequence state (what ``llama_state_seq_get_data`` wrote) with the tokens it
holds, under ``<root>/<identity>/<scope>/<key>.kvs``:

- ``identity``: a hash of the model file and of the context parameters that shape a saved
  state (``LlamaEngine.cache_identity``): a state is only ever read back by a context that
  wrote it the same way. Another model's or another layout's files are in another folder.
- ``scope``: a hash of the cache_scope (the tenant). A lookup reads only its scope's
  entries; the scope's string is in the file's header too, and a file whose header and
  folder disagree is corrupt.
- ``key``: a hash of (identity, scope, tokens).

The file: ``MAGIC``, a 4-byte header length, the header (JSON: identity, scope, token
count, data length, CRC-32 of the tokens and of the data), the tokens (int32), the data.
It is written to a temporary name (mode 0600) and renamed, so a reader never sees half a
file. A file that does not parse, whose lengths disagree with its size, whose identity,
scope or checksums do not match, is skipped, deleted and counted (``corrupt``): its bytes
never reach llama.cpp. The index (scope, tokens, size, last use) is read from the headers
when the cache opens, so a restarted daemon finds what its predecessor saved.

Budget and shares are ``ram_cache.RamCache``'s (the same class keeps the index: its entries'
``data`` is the file's path). Writes run on a thread of their own (``DiskWriter``), never on
the decode loop; reads run on the loop (a restore needs the bytes before the prefill).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .ram_cache import RamCache, RamEntry

log = logging.getLogger(__name__)

MAGIC = b"LLMKVS1\n"
SUFFIX = ".kvs"
HEADER_MAX_BYTES = 4096
_LEN = struct.Struct("<I")
WRITE_QUEUE_MAX = 8  # states waiting for the writer; past it a save is dropped (counted)
WRITING = "\x00writing"  # the owner of an index entry whose file is being written
FORGOTTEN = "\x00forgotten"  # ... and whose scope was evicted meanwhile


def scope_dir_name(cache_scope: str) -> str:
    return hashlib.sha256(b"scope\x00" + cache_scope.encode()).hexdigest()[:32]


def entry_key(identity: str, cache_scope: str, tokens: list[int]) -> str:
    h = hashlib.sha256()
    h.update(identity.encode() + b"\x00" + cache_scope.encode() + b"\x00")
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return h.hexdigest()[:40]


class Corrupt(Exception):
    """A file that is not a state this cache wrote for this identity."""


@dataclass(slots=True)
class Header:
    scope: str
    tokens: list[int]
    data_offset: int
    data_len: int
    data_crc: int


def encode(identity: str, cache_scope: str, tokens: list[int], data: Any) -> tuple[bytes, Any]:
    """The file's head (magic, header, tokens) and its data (any buffer)."""
    packed = struct.pack(f"<{len(tokens)}i", *tokens)
    view = memoryview(data).cast("B")
    header = json.dumps({
        "identity": identity, "scope": cache_scope, "n_tokens": len(tokens),
        "data_len": view.nbytes, "tokens_crc": zlib.crc32(packed), "data_crc": zlib.crc32(view),
    }).encode()
    return MAGIC + _LEN.pack(len(header)) + header + packed, view


def read_header(f: Any, identity: str, file_size: int, max_tokens: int) -> Header:
    """Parse and check a file's head; raise ``Corrupt`` on anything unexpected."""
    head = f.read(len(MAGIC) + _LEN.size)
    if len(head) != len(MAGIC) + _LEN.size or head[: len(MAGIC)] != MAGIC:
        raise Corrupt("bad magic")
    (hlen,) = _LEN.unpack(head[len(MAGIC):])
    if not 0 < hlen <= HEADER_MAX_BYTES:
        raise Corrupt("bad header length")
    raw = f.read(hlen)
    if len(raw) != hlen:
        raise Corrupt("truncated header")
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise Corrupt("header is not JSON") from e
    if not isinstance(meta, dict) or meta.get("identity") != identity:
        raise Corrupt("another model or context layout")
    scope, n, data_len = meta.get("scope"), meta.get("n_tokens"), meta.get("data_len")
    tokens_crc, data_crc = meta.get("tokens_crc"), meta.get("data_crc")
    if not isinstance(scope, str) or not all(
        type(v) is int and v >= 0 for v in (n, data_len, tokens_crc, data_crc)
    ):
        raise Corrupt("bad header fields")
    if not 0 < n <= max_tokens or data_len == 0:
        raise Corrupt("bad sizes")
    offset = len(head) + hlen + 4 * n
    if offset + data_len != file_size:
        raise Corrupt("size does not match the header")
    packed = f.read(4 * n)
    if len(packed) != 4 * n or zlib.crc32(packed) != tokens_crc:
        raise Corrupt("tokens checksum")
    tokens = list(struct.unpack(f"<{n}i", packed))
    return Header(scope, tokens, offset, data_len, data_crc)


class DiskCache:
    """The files of one identity: index, lookup, read (loop thread), write (writer thread).

    ``budget_bytes``: the most the files take (PROMPT_CACHE_DISK_MB); ``tenant_share`` and
    ``partial_max_tokens`` as ``RamCache``'s; ``max_tokens``: the longest state a file may
    hold (the context's size). Every method may be called from any thread (one lock).
    """

    def __init__(
        self,
        root: str | Path,
        identity: str,
        budget_bytes: int,
        max_tokens: int,
        tenant_share: float = 1.0,
        partial_max_tokens: int = 0,
        counters: Counter[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = Path(root)
        self.identity = identity
        self.dir = self.root / identity[:32]
        self.max_tokens = max_tokens
        self.index = RamCache(budget_bytes, tenant_share, partial_max_tokens)
        self.counters: Counter[str] = counters if counters is not None else Counter()
        self._clock = clock
        self._lock = threading.Lock()

    @property
    def budget_bytes(self) -> int:
        return self.index.budget_bytes

    def open(self) -> None:
        """Make this identity's folder (mode 0700) and index the files found there, oldest
        use first; corrupt ones and leftover temporary files are deleted. Files past the budget (a
        smaller budget than the last run's) are evicted."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)  # its own folder only: the root may be shared (or /tmp)
        found: list[tuple[float, Path, Header, int]] = []
        for scope_dir in self.dir.iterdir():
            if not scope_dir.is_dir() or scope_dir.is_symlink():
                self._discard(scope_dir, "not a scope folder")
                continue
            for path in scope_dir.iterdir():
                if path.name.startswith(".tmp-") or path.suffix != SUFFIX or path.is_symlink():
                    self._discard(path, "not a state file")
                    continue
                try:
                    st = path.stat()
                    with open(path, "rb") as f:
                        header = read_header(f, self.identity, st.st_size, self.max_tokens)
                    if scope_dir_name(header.scope) != scope_dir.name:
                        raise Corrupt("scope does not match its folder")
                    if path.stem != entry_key(self.identity, header.scope, header.tokens):
                        raise Corrupt("name does not match its content")
                except (OSError, Corrupt) as e:
                    self._corrupt(path, e)
                    continue
                found.append((st.st_mtime, path, header, st.st_size))
        now = self._clock()
        with self._lock:
            for _mtime, path, header, size in sorted(found, key=lambda x: x[0]):
                evicted, room = self.index.make_room(header.scope, header.tokens, size)
                self._unlink_all(evicted)
                if room:
                    self.index.add(header.scope, header.tokens, path, size, now)
                else:
                    self._discard(path, "past the budget")
        log.info("disk prompt cache %s: %d states, %.1f MB of %.0f MB", self.dir,
                 len(self.index), self.index.total_bytes / 2**20, self.budget_bytes / 2**20)

    # -- the loop thread's side ---------------------------------------------------------

    def lookup(
        self, cache_scope: str, prompt: list[int], limit: int
    ) -> tuple[RamEntry | None, int]:
        with self._lock:
            return self.index.lookup(cache_scope, prompt, limit)

    def usable_prefix(self, entry: RamEntry, prompt: list[int], limit: int) -> int:
        return self.index.usable_prefix(entry, prompt, limit)

    def covers(self, cache_scope: str, tokens: list[int]) -> bool:
        with self._lock:
            return self.index.covers(cache_scope, tokens)

    def read(self, entry: RamEntry) -> bytearray | None:
        """The state's bytes, checked; None (the file deleted and counted) when the file
        is gone, changed or corrupt."""
        path: Path = entry.data
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                header = read_header(f, self.identity, size, self.max_tokens)
                if header.scope != entry.cache_scope or header.tokens != entry.tokens:
                    raise Corrupt("content changed")
                data = bytearray(header.data_len)
                if f.readinto(data) != header.data_len:
                    raise Corrupt("truncated data")
                if zlib.crc32(data) != header.data_crc:
                    raise Corrupt("data checksum")
        except FileNotFoundError:  # another daemon sharing the folder evicted it
            self.counters["disk_missing"] += 1
            self.forget(entry)
            return None
        except (OSError, Corrupt) as e:
            self._corrupt(path, e)
            self.forget(entry)
            return None
        with self._lock:
            self.index.touch(entry, self._clock())
        try:
            os.utime(path)  # the last use survives a restart (the index is rebuilt by mtime)
        except OSError:
            pass
        self.counters["disk_reads"] += 1
        self.counters["disk_read_bytes"] += len(data)
        return data

    def forget(self, entry: RamEntry) -> None:
        with self._lock:
            self.index.discard(entry)

    # -- the writer thread's side -------------------------------------------------------

    def write(self, cache_scope: str, tokens: list[int], data: Any) -> RamEntry | None:
        """Store one state (evicting LRU files first); None when it cannot fit or failed."""
        head, view = encode(self.identity, cache_scope, tokens, data)
        size = len(head) + view.nbytes
        with self._lock:
            if self.index.covers(cache_scope, tokens):
                return None
            if not self.index.fits(cache_scope, size):
                self.counters["disk_rejects"] += 1
                return None
            evicted, room = self.index.make_room(cache_scope, tokens, size)
            if room:  # reserved now (owned: no lookup matches it until it is written)
                entry = self.index.add(cache_scope, tokens, None, size, self._clock(),
                                       owner=WRITING)
        self._unlink_all(evicted)
        if not room:
            self.counters["disk_rejects"] += 1
            return None
        folder = self.dir / scope_dir_name(cache_scope)
        path = folder / (entry_key(self.identity, cache_scope, tokens) + SUFFIX)
        tmp = folder / f".tmp-{uuid.uuid4().hex}"
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(head)
                f.write(view)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("could not write a prompt cache file %s: %s", path, e)
            self.counters["disk_write_failures"] += 1
            tmp.unlink(missing_ok=True)
            self.forget(entry)
            return None
        with self._lock:
            entry.data = path
            forgotten = entry.owner == FORGOTTEN  # its scope was evicted meanwhile
            if forgotten:
                self.index.discard(entry)
            else:
                entry.owner = None
        if forgotten:
            path.unlink(missing_ok=True)
            return None
        self.counters["disk_saves"] += 1
        self.counters["disk_save_bytes"] += size
        self.counters["disk_save_tokens"] += len(tokens)
        return entry

    def evict_scope(self, cache_scope: str) -> int:
        """Delete every file of one scope (an operator's action); returns how many."""
        with self._lock:
            doomed = [e for e in self.index.entries()
                      if e.cache_scope == cache_scope and e.owner is None]
            for e in self.index.entries():
                if e.cache_scope == cache_scope and e.owner == WRITING:
                    e.owner = FORGOTTEN  # the writer deletes it once written
            self.index.evict_scope(cache_scope)
        self._unlink_all(doomed)
        return len(doomed)

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {"disk_budget_bytes": self.budget_bytes, "disk_bytes": self.index.total_bytes,
                    "disk_entries": len(self.index), "disk_dir": str(self.dir)}

    def entries(self) -> list[RamEntry]:
        with self._lock:
            return self.index.entries()

    # -- pieces -------------------------------------------------------------------------

    def _unlink_all(self, entries: list[RamEntry]) -> None:
        for e in entries:
            if isinstance(e.data, Path):
                e.data.unlink(missing_ok=True)
                self.counters["disk_evictions"] += 1
                self.counters["disk_eviction_bytes"] += e.size_bytes

    def _corrupt(self, path: Path, why: Exception) -> None:
        log.warning("prompt cache file %s skipped and deleted: %s", path, why)
        self.counters["disk_corrupt"] += 1
        path.unlink(missing_ok=True)

    def _discard(self, path: Path, why: str) -> None:
        log.info("prompt cache: removing %s (%s)", path, why)
        try:
            if path.is_dir() and not path.is_symlink():
                for child in path.iterdir():
                    child.unlink(missing_ok=True)
                path.rmdir()
            else:
                path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not remove %s: %s", path, e)


@dataclass(slots=True)
class _Job:
    scope: str
    tokens: list[int]
    data: Any
    reason: str  # finish | evict | shutdown


def _pending_key(scope: str, tokens: list[int]) -> tuple[str, int, int]:
    return scope, len(tokens), hash(tuple(tokens))


class DiskWriter:
    """The thread that writes states to a ``DiskCache``: ``submit`` never blocks (a full
    queue drops the save, counted), ``flush`` waits for what was submitted (shutdown)."""

    def __init__(
        self,
        disk: DiskCache,
        on_saved: Callable[[str, int, int, str], None] | None = None,
        max_queue: int = WRITE_QUEUE_MAX,
    ) -> None:
        self.disk = disk
        self.on_saved = on_saved  # (scope, tokens, bytes, reason)
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="disk-cache", daemon=True)
        self._thread.start()
        self._pending: set[tuple[str, int, int]] = set()  # (scope, len, hash) queued, not written
        self._pending_lock = threading.Lock()

    def submit(self, scope: str, tokens: list[int], data: Any, reason: str,
               block_s: float = 0.0) -> bool:
        key = _pending_key(scope, tokens)
        with self._pending_lock:
            if key in self._pending:
                return False
            self._pending.add(key)
        try:
            self._queue.put(_Job(scope, list(tokens), data, reason), timeout=block_s or None,
                            block=block_s > 0)
        except queue.Full:
            with self._pending_lock:
                self._pending.discard(key)
            self.disk.counters["disk_save_dropped"] += 1
            return False
        return True

    def pending(self, scope: str, tokens: list[int]) -> bool:
        with self._pending_lock:
            return _pending_key(scope, tokens) in self._pending

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted state is written (or ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return self._queue.unfinished_tasks == 0

    def close(self, timeout_s: float = 5.0) -> None:
        self.flush(timeout_s)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                entry = self.disk.write(job.scope, job.tokens, job.data)
                self.disk.counters[f"disk_saves_{job.reason}"] += entry is not None
                if entry is not None and self.on_saved is not None:
                    self.on_saved(job.scope, len(job.tokens), entry.size_bytes, job.reason)
            except Exception:  # noqa: BLE001 - a failed save is that save's, never the thread's
                log.exception("prompt cache write failed")
                self.disk.counters["disk_write_failures"] += 1
            finally:
                if job is not None:
                    with self._pending_lock:
                        self._pending.discard(_pending_key(job.scope, job.tokens))
                self._queue.task_done()
