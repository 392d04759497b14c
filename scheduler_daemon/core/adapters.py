"""The daemon's LoRA adapters: loaded on demand, at most ``MAX_LOADED_ADAPTERS``, the least
recently used unloaded first, never one a queued or running request uses.

A job names its adapter as the web resolved it (``wire.protocol.Job.adapter``: id, path,
sha256, scale). ``acquire`` runs on the thread that prepares the job, off the tick: the
first request of an adapter checks its file (the hash the web registered, then
``wire.adapter_check`` against the base model's shapes: llama.cpp's GGUF parser sees nothing
that has not passed) and loads it (``llama_adapter_lora_init``); later ones find it loaded.
An adapter is freed only on the loop thread (``Scheduler`` calls ``retire`` between ticks),
after the context stopped applying it: llama.cpp's context holds the pointers it was given.

Every request of an adapter carries an ``AdapterUse``: its group (adapter and scale: the
scheduler decodes one group per tick) and its tag, which ``scoped`` folds into the request's
cache scope, so no prefix computed under one adapter and scale is reused under another or
without it, on any tier of the prefix cache.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from wire import errors, protocol
from wire.adapter_check import AdapterRefused, check_adapter, read_shapes
from wire.errors import Refusal

log = logging.getLogger(__name__)

SCOPE_SEP = "\x1f"  # between a tenant's cache scope and an adapter's tag (no tenant id has it)
MAX_IDS = 4096  # adapter ids the counters remember (the web registers far fewer)


def scoped(cache_scope: str, use: AdapterUse | None) -> str:
    """The cache scope of a request under ``use`` (its tenant's scope for the base model)."""
    return cache_scope if use is None else f"{cache_scope}{SCOPE_SEP}{use.tag}"


def tenant_scopes(cache_scope: str, scopes: set[str]) -> set[str]:
    """Of ``scopes``, the tenant's own and those of its adapters."""
    return {s for s in scopes if s == cache_scope or s.startswith(cache_scope + SCOPE_SEP)}


@dataclass(frozen=True, slots=True)
class AdapterUse:
    """One request's adapter: which, at what scale, and its llama.cpp handle."""

    id: str
    scale: float
    tag: str  # protocol.adapter_tag: the file's hash and the scale
    handle: Any = field(compare=False, repr=False)

    @property
    def group(self) -> str:
        """Requests of one group share a decode (the context applies one adapter set)."""
        return f"{self.id}@{self.scale!r}"


@dataclass(slots=True)
class _Loaded:
    handle: Any
    sha256: str
    route: str | None = None  # the head of its jobs' affinity chain (wire/affinity.py)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class AdapterRegistry:
    """Thread-safe. ``engine``: ``load_adapter(path)``, ``free_adapter(handle)``;
    ``base_path``: the base model's file (its tensor shapes, read once);
    ``in_use``: the adapter ids the scheduler's requests hold (waiting or running). An
    unloaded adapter's affinity head waits in ``take_unrouted`` for the heartbeat, which
    drops it from the daemon's published summary (routing then stops preferring this
    daemon for that adapter)."""

    def __init__(self, engine: Any, base_path: str, max_loaded: int,
                 in_use: Callable[[], set[str]] = set) -> None:
        self.engine = engine
        self.base_path = base_path
        self.max_loaded = max(1, int(max_loaded))
        self.in_use = in_use
        self._unrouted: list[str] = []  # unloaded adapters' affinity heads
        self._base: tuple[str, dict[str, tuple[int, ...]]] | None = None
        self._loaded: OrderedDict[str, _Loaded] = OrderedDict()  # least recently used first
        self._pending: Counter[str] = Counter()  # acquired, not yet the scheduler's
        self._retiring: list[tuple[str, _Loaded]] = []  # to free on the loop thread
        self._deleted: set[str] = set()  # unload_adapter: never loaded again
        self._lock = threading.Lock()
        self.loads: Counter[str] = Counter()
        self.unloads: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()  # tokens decoded under each adapter
        self._tokens_lock = threading.Lock()  # never held long: the loop thread counts
        self.load_ms: dict[str, float] = {}  # the last load's check + llama.cpp time
        self._last_summary: dict[str, Any] = {}

    # -- the preparing threads --------------------------------------------------------

    @contextmanager
    def hold(self, spec: dict[str, Any] | None,
             route: str | None = None) -> Iterator[AdapterUse | None]:
        """The job's ``AdapterUse`` (None: the base model), loaded, and held until the block
        ends: the caller submits its requests inside it (from then the scheduler's
        ``in_use`` holds it). Refusal: ``adapter_unusable`` (the file fails its check),
        ``adapters_busy`` (the loaded ones are all in use)."""
        if spec is None:
            yield None
            return
        use = self._acquire(spec, route)
        try:
            yield use
        finally:
            with self._lock:
                self._pending[use.id] -= 1
                if self._pending[use.id] <= 0:
                    del self._pending[use.id]

    def _acquire(self, spec: dict[str, Any], route: str | None) -> AdapterUse:
        adapter_id, path, sha = str(spec["id"]), str(spec["path"]), str(spec["sha256"])
        scale = float(spec["scale"])
        with self._lock:  # loads are serialized: two jobs of a new adapter load it once
            if adapter_id in self._deleted:
                raise Refusal(errors.ADAPTER_UNUSABLE, "The adapter was deleted.")
            loaded = self._loaded.get(adapter_id)
            if loaded is not None and loaded.sha256 != sha:  # re-registered with a new file
                self._retire_locked(adapter_id)
                loaded = None
            if loaded is None:
                self._make_room_locked()
                loaded = self._load_locked(adapter_id, path, sha)
            self._loaded.move_to_end(adapter_id)
            if route:
                loaded.route = route
            self._pending[adapter_id] += 1
            return AdapterUse(adapter_id, scale, protocol.adapter_tag(spec), loaded.handle)

    def _load_locked(self, adapter_id: str, path: str, sha: str) -> _Loaded:
        t0 = time.monotonic()
        try:
            if self._base is None:
                self._base = read_shapes(self.base_path)
            check_adapter(path, self._base)  # bounded, sizes first: then the whole hash
            if _sha256(path) != sha:
                raise AdapterRefused("the file is not the one registered (its hash differs)")
        except (AdapterRefused, OSError) as exc:
            log.warning("adapter %s refused: %s", adapter_id, exc)
            raise Refusal(errors.ADAPTER_UNUSABLE,
                          "The adapter's file does not pass the daemon's check.") from None
        handle = self.engine.load_adapter(path)
        loaded = _Loaded(handle, sha)
        self._loaded[adapter_id] = loaded
        self.loads[adapter_id] += 1
        self.load_ms[adapter_id] = (time.monotonic() - t0) * 1000
        self._bound_counters()
        log.info("adapter %s loaded in %.1f ms (%d loaded)", adapter_id,
                 self.load_ms[adapter_id], len(self._loaded))
        return loaded

    def _make_room_locked(self) -> None:
        """Room for one more below ``max_loaded``: the least recently used adapter no
        request holds is retired (freed at the next tick, before this job's first decode),
        or ``adapters_busy``."""
        if len(self._loaded) < self.max_loaded:
            return
        busy = self.in_use() | set(self._pending)
        for adapter_id in list(self._loaded):  # least recently used first
            if adapter_id not in busy:
                self._retire_locked(adapter_id)
                return
        raise Refusal(errors.ADAPTERS_BUSY, "Every loaded adapter is in use; retry shortly.",
                      retry_after_s=1)

    def _retire_locked(self, adapter_id: str) -> None:
        self._retiring.append((adapter_id, self._loaded.pop(adapter_id)))

    # -- the control thread -------------------------------------------------------------

    def delete(self, adapter_id: str) -> None:
        """An operator deleted it: unloaded once no request uses it, never loaded again."""
        with self._lock:
            self._deleted.add(adapter_id)
            if len(self._deleted) > MAX_IDS:
                self._deleted.pop()

    # -- the loop thread ------------------------------------------------------------------

    def retire(self, in_use: set[str]) -> list[Any]:
        """The handles to free now (the caller first stops applying them): those made room
        for, and deleted ones no request uses any more."""
        with self._lock:
            for adapter_id in [a for a in self._loaded if a in self._deleted]:
                if adapter_id not in in_use and adapter_id not in self._pending:
                    self._retire_locked(adapter_id)
            gone, self._retiring = self._retiring, []
            for adapter_id, loaded in gone:
                self.unloads[adapter_id] += 1
                if loaded.route:
                    self._unrouted.append(loaded.route)
        for adapter_id, _loaded in gone:
            log.info("adapter %s unloaded", adapter_id)
        return [loaded.handle for _, loaded in gone]

    @property
    def retiring(self) -> bool:
        """Whether ``retire`` has work (read without the lock, which a load may hold: the
        loop thread asks every turn; a read racing a change says yes, and ``retire`` sees)."""
        try:
            return bool(self._retiring) or any(a in self._deleted for a in list(self._loaded))
        except RuntimeError:  # changed while read
            return True

    def free_all(self) -> list[Any]:
        """Every handle (the daemon stops)."""
        with self._lock:
            gone = self._retiring + list(self._loaded.items())
            self._retiring, self._loaded = [], OrderedDict()
        return [loaded.handle for _, loaded in gone]

    # -- the heartbeat --------------------------------------------------------------------

    def take_unrouted(self) -> list[str]:
        """The affinity heads of adapters unloaded since the last call."""
        with self._lock:
            heads, self._unrouted = self._unrouted, []
        return heads

    def summary(self, wait_s: float = -1) -> dict[str, Any]:
        """For the snapshot: loaded ids (least recently used first) and the counters; while
        a load holds the lock past ``wait_s``, the last summary, marked stale."""
        if not self._lock.acquire(timeout=wait_s):
            return {**self._last_summary, "stale": True}
        try:
            self._last_summary = {
                "loaded": list(self._loaded), "max_loaded": self.max_loaded,
                "loads": dict(self.loads), "unloads": dict(self.unloads),
                "tokens": self._tokens_copy(),
                "load_ms": {k: round(v, 1) for k, v in self.load_ms.items()}}
            return self._last_summary
        finally:
            self._lock.release()

    def count_tokens(self, adapter_id: str, n: int) -> None:
        """Tokens a decode of the loop thread computed under the adapter."""
        with self._tokens_lock:
            self.tokens[adapter_id] += n

    def _tokens_copy(self) -> dict[str, int]:
        with self._tokens_lock:
            return dict(self.tokens)

    def _bound_counters(self) -> None:
        if len(self.loads) > MAX_IDS:  # ids come from the web's registry: far fewer
            for counter in (self.loads, self.unloads):
                counter.clear()
            with self._tokens_lock:
                self.tokens.clear()
            self.load_ms.clear()
