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

import contextlib
import hashlib
import logging
import os
import stat
import tempfile
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from wire import errors, protocol
from wire.adapter_check import MAX_FILE_BYTES, AdapterRefused, check_adapter, read_shapes
from wire.errors import Refusal

log = logging.getLogger(__name__)

SCOPE_SEP = "\x1f"  # between a tenant's cache scope and an adapter's tag (no tenant id has it)
MAX_IDS = 4096  # adapter ids the counters remember (the web registers far fewer)


def scoped(cache_scope: str, use: AdapterUse | None) -> str:
    """The cache scope of a request under ``use`` (its tenant's scope for the base model)."""
    return cache_scope if use is None else f"{cache_scope}{SCOPE_SEP}{use.tag}"


def tenant_of(cache_scope: str) -> str:
    """The tenant's scope of a cache scope (the same for the base model and every adapter
    and scale of the tenant): what fairness, KV shares, queue caps and the prefix cache's
    tenant shares count by, so that no number of adapters or scales multiplies them."""
    return cache_scope.split(SCOPE_SEP, 1)[0]


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
    tenant: str | None = None  # whose adapter (its job's tenant scope)
    # the heads of its jobs' affinity chains (wire/affinity.py: one per tenant and scale)
    routes: set[str] = field(default_factory=set)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class AdapterRegistry:
    """Thread-safe. ``engine``: ``load_adapter(path)``, ``free_adapter(handle)``;
    ``base_path``: the base model's file (its tensor shapes, read once);
    ``in_use``: the adapter ids the scheduler's requests hold (waiting or running). The
    heartbeat publishes the loaded adapters' affinity heads (``routes``) in the daemon's
    summary and drops those of unloaded ones (``take_unrouted``): routing prefers a daemon
    for an adapter's jobs exactly while it holds the adapter loaded."""

    def __init__(self, engine: Any, base_path: str, max_loaded: int,
                 in_use: Callable[[], set[str]] = set, root: str | None = None) -> None:
        self.engine = engine
        self.base_path = base_path
        self.max_loaded = max(1, int(max_loaded))
        self.per_tenant = max(1, self.max_loaded // 2)  # loaded adapters of one tenant
        self.in_use = in_use
        self.root = os.path.realpath(root) if root else None  # ADAPTERS_DIR: files inside it
        self._copies: str | None = None  # the private folder of files being loaded
        self.load_lock = threading.Lock()  # a load, or the loop thread's frees
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
    def hold(self, spec: dict[str, Any] | None, route: str | None = None,
             tenant: str | None = None) -> Iterator[AdapterUse | None]:
        """The job's ``AdapterUse`` (None: the base model), loaded, and held until the block
        ends: the caller submits its requests inside it (from then the scheduler's
        ``in_use`` holds it). Refusal: ``adapter_unusable`` (the file fails its check),
        ``adapters_busy`` (the loaded ones are all in use), ``model_not_found`` (deleted)."""
        if spec is None:
            yield None
            return
        use = self._acquire(spec, route, tenant)
        try:
            yield use
        finally:
            with self._lock:
                self._pending[use.id] -= 1
                if self._pending[use.id] <= 0:
                    del self._pending[use.id]

    def _acquire(self, spec: dict[str, Any], route: str | None,
                 tenant: str | None) -> AdapterUse:
        adapter_id, path, sha = str(spec["id"]), str(spec["path"]), str(spec["sha256"])
        scale = float(spec["scale"])
        use = self._take_loaded(adapter_id, sha, scale, spec, route)
        if use is not None:
            return use
        # Loads run one at a time (the load lock, which the loop thread's frees also take:
        # llama.cpp's model keeps its adapters in a set both change), outside the registry's
        # lock: the loop thread never waits for a file to be read.
        with self.load_lock:
            use = self._take_loaded(adapter_id, sha, scale, spec, route)  # loaded meanwhile?
            if use is not None:
                return use
            with self._lock:
                self._make_room_locked(tenant, dry_run=True)  # adapters_busy before loading
            t0 = time.monotonic()
            handle = self._load(adapter_id, path, sha)
            with self._lock:
                try:
                    self._make_room_locked(tenant)
                except Refusal:
                    self._retiring.append((adapter_id, _Loaded(handle, sha)))  # freed next tick
                    raise
                self._loaded[adapter_id] = _Loaded(handle, sha, tenant)
                self.loads[adapter_id] += 1
                self.load_ms[adapter_id] = (time.monotonic() - t0) * 1000
                self._bound_counters()
                log.info("adapter %s loaded in %.1f ms (%d loaded)", adapter_id,
                         self.load_ms[adapter_id], len(self._loaded))
            use = self._take_loaded(adapter_id, sha, scale, spec, route)
            assert use is not None
            return use

    def _take_loaded(self, adapter_id: str, sha: str, scale: float, spec: dict[str, Any],
                     route: str | None) -> AdapterUse | None:
        """The use of a loaded adapter, held (None: not loaded)."""
        with self._lock:
            if adapter_id in self._deleted:  # (a web process resolved it before it knew)
                raise Refusal(errors.MODEL_NOT_FOUND, "The adapter does not exist (deleted).",
                              param="model")
            loaded = self._loaded.get(adapter_id)
            if loaded is not None and loaded.sha256 != sha:  # another file under its id
                if adapter_id in self.in_use() or adapter_id in self._pending:
                    raise Refusal(errors.ADAPTER_UNUSABLE, "The adapter's file changed while "
                                  "requests use it; retry shortly.", retry_after_s=1)
                self._retire_locked(adapter_id)
                loaded = None
            if loaded is None:
                return None
            self._loaded.move_to_end(adapter_id)
            if route:
                loaded.routes.add(route)
            self._pending[adapter_id] += 1
            return AdapterUse(adapter_id, scale, protocol.adapter_tag(spec), loaded.handle)

    def _load(self, adapter_id: str, path: str, sha: str) -> Any:
        """Check and load the file (the load lock held): read once, through a descriptor
        that follows no last link and blocks on nothing, into a private copy; the copy is
        what is checked, hashed and given to llama.cpp (no file swapped in after the check
        reaches the parser), and is deleted once loaded (llama.cpp keeps the data)."""
        copy = None
        try:
            if self._base is None:
                self._base = read_shapes(self.base_path)
            copy = self._private_copy(path)
            check_adapter(copy, self._base)  # bounded, sizes first
            if _sha256(copy) != sha:
                raise AdapterRefused("the file is not the one registered (its hash differs)")
            return self.engine.load_adapter(copy)
        except (AdapterRefused, OSError, RuntimeError) as exc:  # RuntimeError: EngineError
            log.warning("adapter %s refused: %s", adapter_id, exc)
            raise Refusal(errors.ADAPTER_UNUSABLE,
                          "The adapter's file does not pass the daemon's check.") from None
        finally:
            if copy is not None:
                with contextlib.suppress(OSError):
                    os.unlink(copy)

    def _private_copy(self, path: str) -> str:
        if self.root is not None:
            real = os.path.realpath(path)
            if os.path.commonpath([real, self.root]) != self.root:
                raise AdapterRefused("the file is not inside ADAPTERS_DIR")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise AdapterRefused("not a regular file")
            if st.st_size > MAX_FILE_BYTES:
                raise AdapterRefused(f"the file is larger than {MAX_FILE_BYTES} bytes")
            if self._copies is None:
                self._copies = tempfile.mkdtemp(prefix="adapters-")  # mode 0700
            out = os.path.join(self._copies, f"{uuid.uuid4().hex}.gguf")
            with os.fdopen(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600),
                           "wb") as dst:
                left = MAX_FILE_BYTES + 1
                while block := os.read(fd, min(1 << 20, left)):
                    dst.write(block)
                    left -= len(block)
                    if left <= 0:
                        raise AdapterRefused(f"the file is larger than {MAX_FILE_BYTES} bytes")
            return out
        finally:
            os.close(fd)

    def _make_room_locked(self, tenant: str | None, dry_run: bool = False) -> None:
        """Room for one more of ``tenant``'s adapters: a tenant holds at most half of
        ``max_loaded`` (at least one), so no tenant's adapters, busy or not, can take every
        place; past that, or past ``max_loaded``, the least recently used adapter (the
        tenant's own first) that no request holds is retired (freed at the next tick,
        before this job's first decode); else ``adapters_busy``."""
        mine = [a for a, loaded in self._loaded.items() if loaded.tenant == tenant]
        if tenant is not None and len(mine) >= self.per_tenant:
            candidates = mine
        elif len(self._loaded) >= self.max_loaded:
            candidates = list(self._loaded)  # least recently used first
        else:
            return
        busy = self.in_use() | set(self._pending)
        for adapter_id in candidates:
            if adapter_id not in busy:
                if not dry_run:
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
                self._unrouted.extend(sorted(loaded.routes))
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

    def routes(self) -> set[str]:
        """The affinity heads of the loaded adapters' jobs (one per tenant and scale)."""
        with self._lock:
            return {h for loaded in self._loaded.values() for h in loaded.routes}

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
