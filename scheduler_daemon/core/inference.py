"""The in-process inference core: an engine, a scheduler and the thread that ticks it.

Usage::

    core = InferenceCore.from_settings()          # or InferenceCore(engine, SchedulerConfig())
    core.start()
    handle = core.submit(messages=[{"role": "user", "content": "Hi"}],
                         params=SamplingParams(max_tokens=32), cache_scope="tenant-1")
    for event in handle.events():                 # TokenEvent..., then one FinishedEvent
        ...
    core.stop()

``submit`` raises ``errors.Refusal`` (queue_full, context_length_exceeded, empty_prompt,
invalid_request_error naming the field) before anything is queued. Events of every
request go to ``listeners`` (the daemon's event writer hooks in there); ``submit`` also
returns a handle that collects its own request's events, ``enqueue`` (what the daemon
uses) does not.

What is checked here is what needs the model or guards it: the prompt's size in bytes
before anything renders it, the shape of chat messages, token ids within the vocabulary,
the token count (the scheduler), the grammar (the engine, where it is compiled). The
web validated everything else before the job was queued.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from wire import errors, protocol
from wire.errors import InvalidParameter, Refusal
from wire.sampling import SamplingParams

from .adapters import SCOPE_SEP, AdapterRegistry
from .chat import ChatRenderer, message_calls, message_pairs, tool_grammar
from .choices import ChoiceGroups
from .disk_cache import DiskCache
from .embeddings import DEFAULT_EMBEDDINGS_TENANT_TOKENS, EmbeddingsQueue
from .job_input import tool_spec
from .liveness import RUNNING, STUCK_AFTER_S, LoopClock
from .scheduler import Scheduler, SchedulerConfig
from .state import Continuation, Event, FinishedEvent, Request, TickStats, TokenEvent

log = logging.getLogger(__name__)

DEFAULT_MAX_PROMPT_BYTES = 256 * 1024
DEFAULT_MAX_LOADED_ADAPTERS = 8
SLOW_TURN_S = 5.0  # a loop turn longer than this is logged with what its tick did
SNAPSHOT_LOCK_WAIT_S = 0.2  # the heartbeat's wait for the scheduler's lock, at most
MAX_BLAMELESS_TICK_FAILURES = 3  # ticks in a row that fail with no request in the batch


def _native_call(method: Callable[..., Any]) -> Callable[..., Any]:
    """A core method that other threads call and that runs llama.cpp's code (templates,
    tokenizer, grammar compile): watched by the loop clock like a loop turn."""
    @functools.wraps(method)
    def watched(self: InferenceCore, *args: Any, **kwargs: Any) -> Any:
        with self.clock.calling(kwargs.get("request_id")):
            return method(self, *args, **kwargs)
    return watched


@dataclass(slots=True)
class Completion:
    """A whole reply: the text and the final event."""

    text: str
    finished: FinishedEvent


class RequestHandle:
    """A submitted request: iterate its events, or wait for the whole reply."""

    def __init__(self, request_id: str, core: InferenceCore) -> None:
        self.id = request_id
        self._core = core
        self._events: queue.Queue[Event] = queue.Queue()
        self.prompt_tokens = 0

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Token events, then the FinishedEvent. ``timeout`` bounds each wait (queue.Empty)."""
        while True:
            event = self._events.get(timeout=timeout)
            yield event
            if isinstance(event, FinishedEvent):
                return

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the end; return all text and the final event."""
        parts = []
        for event in self.events(timeout):
            if isinstance(event, TokenEvent):
                parts.append(event.text)
            else:
                return Completion("".join(parts), event)
        raise AssertionError("events() ended without a FinishedEvent")  # pragma: no cover

    def cancel(self) -> bool:
        return self._core.cancel(self.id)


class InferenceCore:
    """Owns the scheduler loop thread; safe to call from any thread."""

    def __init__(
        self,
        engine: Any,
        config: SchedulerConfig,
        chat_template: str = "",
        default_system: str = "",
        on_tick: Callable[[TickStats], None] | None = None,
        max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
        embeddings: bool = True,
        embeddings_tenant_tokens: int = DEFAULT_EMBEDDINGS_TENANT_TOKENS,
        embeddings_tenant_jobs: int | None = None,
        disk: DiskCache | None = None,
        shutdown_save_s: float = 5.0,
        max_loaded_adapters: int = DEFAULT_MAX_LOADED_ADAPTERS,
        adapters_dir: str | None = None,
    ) -> None:
        """``max_prompt_bytes`` (MAX_PROMPT_BYTES): longer prompt text is refused before
        anything renders or tokenizes it. ``embeddings`` (EMBEDDINGS): embeddings jobs are
        served (a second context, made at the first one); ``embeddings_tenant_tokens``
        (EMBEDDINGS_TENANT_TOKENS): the embeddings tokens one tenant's jobs may hold here;
        ``embeddings_tenant_jobs``: the embeddings jobs one tenant may hold here (default: a
        quarter of ``config.max_queue``, the embeddings queue, so that no tenant fills it).
        ``disk``: the prefix cache's disk tier (opened); ``stop`` saves the slots' and the RAM
        tier's states to it for at most ``shutdown_save_s`` (PROMPT_CACHE_SHUTDOWN_S).
        ``max_loaded_adapters`` (MAX_LOADED_ADAPTERS): LoRA adapters loaded at once;
        ``adapters_dir`` (ADAPTERS_DIR): where their files must lie (None: anywhere).
        ``default_system``: the catalog's default system prompt for this model (a chat
        without a system or developer message gets it first)."""
        self.engine = engine
        self.embeddings = embeddings
        self._embed_owed_s = 0.0  # embeddings time not yet matched by generation time
        self.max_prompt_bytes = max_prompt_bytes
        # called at the start of each loop turn, before its tick (the composition root's
        # fault hooks: run_scheduler.abort_when_marked)
        self.turn_hooks: list[Callable[[], None]] = []
        self.chat = ChatRenderer(engine, chat_template, default_system)
        self.scheduler = Scheduler(engine, config, self._dispatch, on_tick=self._tick, disk=disk)
        self.adapters = AdapterRegistry(engine, getattr(engine, "model_path", ""),
                                        max_loaded_adapters, self.scheduler.adapters_in_use,
                                        root=adapters_dir)
        self.scheduler.adapters = self.adapters
        self.shutdown_save_s = shutdown_save_s
        self.listeners: list[Callable[[Event], None]] = []
        self.tick_listeners: list[Callable[[TickStats], None]] = [on_tick] if on_tick else []
        self._handles: dict[str, RequestHandle] = {}  # guarded by the scheduler's lock
        # requests of several choices (n > 1): each choice is a request of the scheduler's
        # ("<id>#<i>"), their events merged into the request's (choices.py)
        self._choices = ChoiceGroups(self.scheduler, self._handles)
        # the embeddings jobs, decoded between two ticks on the loop thread (embeddings.py)
        self._embedding_queue = EmbeddingsQueue(engine, config, self.scheduler.wake,
                                                embeddings_tenant_tokens,
                                                embeddings_tenant_jobs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # the loop's marks, read without its lock: the heartbeat, the supervisor's watchdog
        self.clock = LoopClock()
        self.stuck_after_s = STUCK_AFTER_S  # the snapshot says "stuck" past this
        self.scheduler.on_sampling = lambda started: self.clock.sampling(started)
        self.longest_turn_s = 0.0  # since start: how near legitimate work comes to a hang
        self._last_tick_stats: TickStats | None = None
        self._last_scheduler_snapshot: dict[str, Any] = {}

    @property
    def embeddings_tenant_tokens(self) -> int:
        """The embeddings tokens one tenant's jobs may hold here."""
        return self._embedding_queue.tenant_tokens

    @embeddings_tenant_tokens.setter
    def embeddings_tenant_tokens(self, value: int) -> None:
        self._embedding_queue.tenant_tokens = value

    @property
    def embeddings_tenant_jobs(self) -> int:
        """The embeddings jobs one tenant may hold here."""
        return self._embedding_queue.tenant_jobs

    @embeddings_tenant_jobs.setter
    def embeddings_tenant_jobs(self, value: int) -> None:
        self._embedding_queue.tenant_jobs = value

    @classmethod
    def from_settings(cls, **overrides: Any) -> InferenceCore:
        """Load the model and size everything from Django settings (keyword overrides win)."""
        from django.conf import settings

        from ..llama.engine import EngineConfig, LlamaEngine

        def get(name: str) -> Any:
            return overrides.get(name.lower(), getattr(settings, name))

        if get("ENGINE_STANDIN"):  # a benchmark's stand-in for llama.cpp (never the default)
            engine = _standin_engine(get("ENGINE_STANDIN"), get("N_CTX"), get("N_BATCH"),
                                     get("N_PARALLEL") + 1, get("ENGINE_STANDIN_RATE"))
        else:
            engine = LlamaEngine(
                EngineConfig(
                    model_path=str(get("MODEL_PATH")),
                    n_ctx=get("N_CTX"),
                    n_batch=get("N_BATCH"),
                    n_seq_max=get("N_PARALLEL") + 1,  # the slots and the prefix cache's park
                    n_threads=get("N_THREADS") or os.cpu_count() or 1,
                    n_gpu_layers=get("N_GPU_LAYERS"),
                )
            )
        config = SchedulerConfig(
            chunk_size=get("CHUNK_SIZE"),
            prompts_per_tick=get("PREFILL_PROMPTS_PER_TICK"),
            max_queue=get("MAX_QUEUE"),
            default_max_tokens=get("DEFAULT_MAX_TOKENS"),
            kv_block_tokens=get("KV_BLOCK_TOKENS"),
            cache_prompt=get("CACHE_PROMPT"),
            ram_cache_bytes=get("PROMPT_CACHE_RAM_MB") * 2**20,
            idle_slots_to_ram=get("IDLE_SLOTS_TO_RAM"),
            ram_tenant_share=get("PROMPT_CACHE_TENANT_SHARE"),
            kv_scope_share=get("KV_TENANT_SHARE"),
            preemption=get("PREEMPTION"),
            preempt_min_tokens=get("PREEMPT_MIN_TOKENS"),
            max_queue_per_scope=get("MAX_QUEUE_PER_TENANT"),
            park_seq=True,
            disk_min_tokens=get("PROMPT_CACHE_DISK_MIN_TOKENS"),
        )
        disk = None
        if get("PROMPT_CACHE_DISK_MB") > 0 and get("PROMPT_CACHE_DIR") and get("CACHE_PROMPT"):
            disk = DiskCache(
                get("PROMPT_CACHE_DIR"), engine.cache_identity, get("PROMPT_CACHE_DISK_MB") * 2**20,
                max_tokens=engine.n_ctx, tenant_share=get("PROMPT_CACHE_TENANT_SHARE"),
                partial_max_tokens=engine.n_swa,
            )
            disk.open()
        max_prompt_bytes = overrides.get(
            "max_prompt_bytes", getattr(settings, "MAX_PROMPT_BYTES", DEFAULT_MAX_PROMPT_BYTES)
        )
        from config.models import CATALOG

        # the catalog's model, not a benchmark's stand-in for it
        catalog = None if get("ENGINE_STANDIN") else CATALOG.get(get("MODEL_NAME"))
        core = cls(
            engine,
            config,
            chat_template=get("CHAT_TEMPLATE") or "",
            default_system=overrides.get("default_system", catalog.default_system_prompt
                                         if catalog else ""),
            max_prompt_bytes=max_prompt_bytes,
            embeddings=bool(overrides.get("embeddings", getattr(settings, "EMBEDDINGS", True))),
            embeddings_tenant_tokens=int(overrides.get(
                "embeddings_tenant_tokens", getattr(settings, "EMBEDDINGS_TENANT_TOKENS",
                                                    DEFAULT_EMBEDDINGS_TENANT_TOKENS))),
            disk=disk,
            shutdown_save_s=get("PROMPT_CACHE_SHUTDOWN_S"),
            max_loaded_adapters=get("MAX_LOADED_ADAPTERS"),
            adapters_dir=get("ADAPTERS_DIR"),
        )
        core.max_answer_bytes = int(overrides.get(
            "max_vocab_answer_bytes", getattr(settings, "MAX_VOCAB_ANSWER_BYTES",
                                              core.max_answer_bytes)))
        return core

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread."""
        self._thread = threading.Thread(target=self._loop, name="scheduler-loop", daemon=True)
        self._thread.start()

    def stop(self, grace_s: float = 10.0, hand_back: bool = False) -> list[str]:
        """Stop admitting, let in-flight work finish for ``grace_s``, then cancel the rest,
        join. ``hand_back`` (the daemon): requests not started are dropped at once and the
        rest after the grace instead of cancelled, without an end (another daemon serves or
        continues them); returns their ids."""
        self.scheduler.stop_admitting()
        handed_back = self.scheduler.hand_back(waiting_only=True) if hand_back else []
        deadline = time.monotonic() + grace_s
        while self.scheduler.has_work() and time.monotonic() < deadline:
            time.sleep(0.05)
            if hand_back:  # requests waiting for a slot are better served elsewhere now
                handed_back += self.scheduler.hand_back(waiting_only=True)
        if hand_back:
            handed_back += self.scheduler.hand_back()
            handed_back = self._choices.parents_handed_back(handed_back)
        else:
            self.scheduler.cancel_all()
        while self.scheduler.has_work() and self._thread and self._thread.is_alive():
            time.sleep(0.01)
        while (self._embedding_queue and self._thread and self._thread.is_alive()
               and time.monotonic() < deadline):
            time.sleep(0.01)
        handed_back += self._embedding_queue.end_all(hand_back)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._save_for_restart()
        return handed_back

    def _save_for_restart(self) -> None:
        """The disk tier's ``shutdown`` saves: no decode runs any more (the loop ended), so
        this thread may read the slots' states."""
        cache = self.scheduler.cache
        if cache.writer is None:
            return
        t0 = time.monotonic()
        with self.scheduler.lock:
            cache.settle()
            queued = cache.persist_all(self.scheduler.slots(), self.shutdown_save_s)
        cache.writer.close(max(0.0, self.shutdown_save_s - (time.monotonic() - t0)))
        log.info("prompt cache: %d states saved to disk at shutdown in %.0f ms", queued,
                 1000 * (time.monotonic() - t0))

    def _loop(self) -> None:
        """Tick until stopped. A tick that raises fails the requests of its batch, not every
        request; only ticks that keep failing with no request to blame (the engine itself is
        unusable) fail everything in flight."""
        try:
            self._turns()
        finally:
            self.clock.stop()  # ended on purpose: no watchdog kills a draining daemon

    def _turns(self) -> None:
        failures = 0
        last = time.monotonic()
        while not self._stop.is_set():
            now = self.clock.mark()  # the previous turn completed (the watchdog reads this)
            if now - last > SLOW_TURN_S:
                self._log_slow_turn(now - last)
            self.longest_turn_s, last = max(self.longest_turn_s, now - last), now
            try:
                for hook in self.turn_hooks:
                    hook()
                if self.adapters.retiring:  # idle too: a deleted adapter goes now
                    self.scheduler.retire_adapters()
                generating = self.scheduler.has_work()
                embedded = False
                if self._embedding_queue and (not generating or self._embed_owed_s <= 0):
                    t0 = time.monotonic()  # between ticks, on this thread
                    embedded = self._embedding_queue.run_one()
                    self._embed_owed_s += time.monotonic() - t0
                if generating:
                    t0 = time.monotonic()
                    self.scheduler.step()
                    # generation and embeddings take turns by time when both have work
                    self._embed_owed_s = max(-1.0, self._embed_owed_s - (time.monotonic() - t0))
                elif not embedded:
                    self._embed_owed_s = 0.0
                    self.scheduler.wait_for_work(0.25)
                failures = 0
            except Exception as exc:
                self.scheduler.counters["tick_failures"] += 1
                blamed = self.scheduler.fail_tick(exc)
                log.exception("scheduler tick failed; failed the %d requests of its batch", blamed)
                failures = 0 if blamed else failures + 1
                if failures >= MAX_BLAMELESS_TICK_FAILURES:
                    log.error("the engine looks unusable; failing every request in flight")
                    self.scheduler.fail_all()
                    failures = 0

    # -- requests -----------------------------------------------------------------

    def submit(self, prompt: str | list[int] | None = None, request_id: str | None = None,
               **arguments: Any) -> RequestHandle:
        """``enqueue`` (same arguments), and a handle that receives this request's events."""
        handle = RequestHandle(request_id or uuid.uuid4().hex, self)
        handle.prompt_tokens = self.enqueue(prompt, request_id=handle.id, handle=handle,
                                            **arguments)
        return handle

    @_native_call
    def enqueue(
        self,
        prompt: str | list[int] | None = None,
        messages: Any = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_scope: str = "",
        session: str | None = None,
        cache_prompt: bool | None = None,
        max_queued: int | None = None,
        handle: RequestHandle | None = None,
        continuation: Continuation | None = None,
        deadline: float | None = None,
        since: float | None = None,
        n: int = 1,
        prompts: list[Any] | None = None,
        session_prefix: list[int] | None = None,
        keep_tokens: bool = False,
        adapter: dict[str, Any] | None = None,
        route: str | None = None,
        tools: dict[str, Any] | None = None,
    ) -> int:
        """Tokenize and queue a completion (``prompt``: text or token ids) or a chat
        (``messages``: ``[{"role", "content"}]``); returns the prompt's token count. Its
        events go to ``listeners`` (and ``handle``). ``max_queued``: this scope's cap on
        waiting requests (None: the configured one). ``deadline`` (unix seconds): past it
        the request ends with ``timeout``; already past, it is refused. ``continuation``:
        what a dead daemon had generated for it (``state.Continuation``); ``since`` (unix
        seconds): when it was first queued, for its timings. ``n`` > 1: that many choices,
        each a request of the scheduler's with the same prompt (prefilled once: the
        followers copy the leader's cells) and its own sampler (seed + index). ``prompts``
        (instead of ``prompt``): a completion's several prompts, ``n`` choices each (choice
        ``p * n + j``), at most MAX_CHOICES choices in all. ``session_prefix``: a session's
        conversation so far (its tokens): ``prompt`` (text) or ``messages`` are its new turn,
        appended (``continuation_tokens``); ``keep_tokens``: the request's end carries the
        conversation's tokens (a session's turn). ``adapter``: the job's LoRA adapter
        (``wire.protocol.Job.adapter``), loaded here if it is not (core/adapters.py); its
        tag is part of the cache scope; ``route``: its affinity chain's head (kept in the
        summary while the adapter stays loaded). ``tools``: a chat's tools for this model's
        template (``job_input.tool_spec``): rendered by the template, the reply's grammar
        in its tool-call format (``chat.tool_grammar``) from the call's JSON schema."""
        _check_choices(n, prompt, messages, prompts, continuation)
        now = arrival = time.monotonic()
        if since is not None:  # a continued request's clock starts when it was first queued
            arrival -= min(max(0.0, time.time() - since), 24 * 3600.0)
        if deadline is not None and time.time() >= deadline:  # before anything costly
            raise Refusal(errors.TIMEOUT, "The request's deadline (timeout) passed before it "
                          "started.")
        if not isinstance(cache_scope, str):  # a key of the scheduler's own maps
            raise InvalidParameter("cache_scope", "must be a string")
        if session is not None and not isinstance(session, str):
            raise InvalidParameter("session", "must be a string")
        choices = n * (len(prompts) if prompts is not None else 1)
        self.scheduler.check_capacity(cache_scope, max_queued, choices)  # before tokenizing
        tenant = cache_scope
        if adapter is not None:  # the tenant's scope under this adapter and scale
            cache_scope = f"{cache_scope}{SCOPE_SEP}{protocol.adapter_tag(adapter)}"
        request_id = request_id or uuid.uuid4().hex
        params = params or SamplingParams()
        if tools is not None:
            if messages is None or session_prefix is not None or n != 1:
                raise InvalidParameter("tools", "tools come with a chat of one choice, not "
                                                "a session's turn")
            params = self._tool_params(params, tools)
        if prompts is not None:
            each = self._prompt_list_tokens(prompts)
            batch, n_prompt = [tokens for tokens in each for _ in range(n)], sum(map(len, each))
        else:
            if session_prefix is not None:
                if n != 1:
                    raise InvalidParameter("n", "a session's turn has one choice")
                tokens = list(session_prefix) + self.continuation_tokens(prompt, messages)
            else:
                tokens = self.prompt_tokens(prompt, messages, tools)
            batch, n_prompt = [tokens] * n, len(tokens)
        # the adapter is loaded (off the tick) once the prompt is known to be usable, and
        # held until the scheduler holds the job's requests
        with self.adapters.hold(adapter, route, tenant) as use:
            shared = dict(cache_scope=cache_scope, session=session, cache_prompt=cache_prompt,
                          max_queued=max_queued, adapter=use, arrival=arrival,
                          # the scheduler's clock is monotonic; a wall-clock deadline
                          # crosses daemons
                          deadline=None if deadline is None else now + (deadline - time.time()))
            if len(batch) > 1 or prompts is not None:
                return self._choices.enqueue(batch, n_prompt, request_id, handle, params, shared)
            self._submit_one(Request(id=request_id, prompt_tokens=batch[0], params=params,
                                     continuation=continuation, keep_tokens=keep_tokens,
                                     **shared), handle)
            return n_prompt

    def _submit_one(self, request: Request, handle: RequestHandle | None) -> None:
        """Queue a request of one choice; its events go to ``handle`` too."""
        if handle is None:  # the daemon's path: the scheduler refuses a duplicate id itself
            self.scheduler.submit(request)
            return
        # The handle goes in before the request is queued (events are emitted under the
        # scheduler's lock: none can outrun it), but the submit runs outside that lock: it
        # compiles the request's grammar, and every tick waits for the lock.
        with self.scheduler.lock:
            if request.id in self._handles or request.id in self.scheduler.request_ids():
                raise Refusal(errors.DUPLICATE_ID, f"request id {request.id} is already in use")
            self._handles[request.id] = handle
        try:
            self.scheduler.submit(request)
        except BaseException:
            with self.scheduler.lock:
                self._handles.pop(request.id, None)
            raise

    def prompt_tokens(self, prompt: str | list[int] | None, messages: Any,
                      tools: dict[str, Any] | None = None) -> list[int]:
        """Token ids for a prompt string, a list of token ids, or chat messages (with the
        tools the template renders, ``tools``)."""
        if (prompt is None) == (messages is None):
            raise InvalidParameter("prompt", "give exactly one of prompt or messages")
        if messages is not None:
            pairs = self._pairs(messages)  # measured before anything renders them
            if tools is None:
                return self.engine.tokenize_segments(self.chat.segments(pairs))
            calls = message_calls(messages)
            self._check_size(sum(_utf8_len(c, "messages") for _, c in pairs) + sum(
                _utf8_len(c["arguments"], "messages") for each in calls.values() for c in each)
                + tools["size"], "messages")
            return self.engine.tokenize_segments(
                self.chat.segments(pairs, tools["functions"], calls))
        if isinstance(prompt, str):
            self._check_size(_utf8_len(prompt, "prompt"), "prompt")
            return self._tokenize(prompt, "prompt") if prompt else []
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            if any(not 0 <= t < self.engine.n_vocab for t in prompt):
                raise InvalidParameter("prompt", "token ids must be within the vocabulary")
            return list(prompt)
        raise InvalidParameter("prompt", "must be a string or a list of token ids")

    def continuation_tokens(self, prompt: str | None, messages: Any) -> list[int]:
        """A session's new turn as the tokens that follow its conversation: a chat's
        messages after the assistant's last reply (``ChatRenderer.continuation_segments``),
        or a completion's text as it is (no BOS)."""
        if (prompt is None) == (messages is None):
            raise InvalidParameter("prompt", "give exactly one of prompt or messages")
        if messages is not None:
            pairs = self._pairs(messages)  # measured before anything renders them
            return self.engine.tokenize_segments(self.chat.continuation_segments(pairs),
                                                 bos=False)
        if not isinstance(prompt, str) or not prompt:
            raise InvalidParameter("prompt", "a session's continued turn is non-empty text")
        self._check_size(_utf8_len(prompt, "prompt"), "prompt")
        return self._tokenize(prompt, "prompt", add_special=False)

    def _tool_params(self, params: SamplingParams, tools: dict[str, Any]) -> SamplingParams:
        """``params`` whose grammar is the reply's in the template's tool-call format, made
        from the job's JSON schema of one call (``{"name", "arguments"}``)."""
        family = self.chat.tools_family
        if family is None:
            raise InvalidParameter("tools", "this model's chat template does not render tools")
        if params.json_schema is None or params.grammar is not None:
            raise InvalidParameter("tools", "a job with tools has the JSON schema of its call")
        call = self.engine.schema_grammar(params.json_schema, "tools", ("name", "arguments"))
        return dataclasses.replace(params, grammar=tool_grammar(family, call, tools["mode"]),
                                   json_schema=None)

    def _pairs(self, messages: Any) -> list[tuple[str, str]]:
        """Chat messages as (role, text) pairs, their text within the size limit."""
        pairs = message_pairs(messages)
        self._check_size(sum(_utf8_len(c, "messages") for _, c in pairs), "messages")
        return pairs

    def _prompt_list_tokens(self, prompts: list[Any]) -> list[list[int]]:
        """A completion's several prompts as token ids, the list's text within the size
        limit."""
        self._check_size(sum(_utf8_len(p, "prompt") for p in prompts if isinstance(p, str)),
                         "prompt")
        return [self._prompt_item(p, f"prompt[{i}]") for i, p in enumerate(prompts)]

    def _prompt_item(self, item: Any, field: str) -> list[int]:
        """One prompt of a list of prompts: text or token ids, not empty."""
        if isinstance(item, str) and item:
            return self._tokenize(item, field)
        if isinstance(item, list) and item and all(type(t) is int for t in item):
            if any(not 0 <= t < self.engine.n_vocab for t in item):
                raise InvalidParameter(field, "token ids must be within the vocabulary")
            return list(item)
        raise InvalidParameter(field, "must be a non-empty string or list of token ids")

    # -- embeddings -----------------------------------------------------------------

    @_native_call
    def embedding_inputs(self, inputs: Any) -> list[list[int]]:
        """An embeddings job's inputs (strings or token-id lists, as the web checked them)
        as token ids, each within the embeddings context; ``InvalidParameter`` or the
        context-length refusal names the input."""
        if not self.embeddings:
            raise InvalidParameter("model", "this model's daemon serves no embeddings")
        if not isinstance(inputs, list) or not 0 < len(inputs) <= protocol.MAX_EMBEDDING_INPUTS:
            raise InvalidParameter("input", f"must be 1 to {protocol.MAX_EMBEDDING_INPUTS} "
                                   "inputs")
        self._check_size(sum(_utf8_len(t, "input") for t in inputs if isinstance(t, str)),
                         "input")
        limit = min(protocol.EMBEDDING_N_CTX, self.engine.n_ctx)
        out: list[list[int]] = []
        for i, item in enumerate(inputs):
            where = f"input[{i}]"
            if isinstance(item, str):
                tokens = self._tokenize(item, where) if item else []
            elif isinstance(item, list) and all(type(t) is int for t in item):
                if any(not 0 <= t < self.engine.n_vocab for t in item):
                    raise InvalidParameter(where, "token ids must be within the vocabulary")
                tokens = list(item)
            else:
                raise InvalidParameter(where, "must be a string or a list of token ids")
            if not tokens:
                raise InvalidParameter(where, "must not be empty")
            if len(tokens) > limit:
                raise Refusal(errors.CONTEXT_LENGTH_EXCEEDED,
                              f"{where} is {len(tokens)} tokens; an input has at most {limit}",
                              param=where, prompt_tokens=len(tokens), n_ctx=limit)
            out.append(tokens)
            total = sum(len(t) for t in out)
            if total > protocol.MAX_EMBEDDING_TOKENS:
                raise Refusal(errors.CONTEXT_LENGTH_EXCEEDED,
                              f"input has more than {protocol.MAX_EMBEDDING_TOKENS} tokens; a "
                              "request has at most that many", param="input",
                              max_tokens=protocol.MAX_EMBEDDING_TOKENS)
        return out

    def check_embeddings_room(self, scope: str, n_tokens: int = 0) -> None:
        """Refuse an embeddings job the daemon will not hold (before its text is tokenized
        with ``n_tokens`` 0, then with its tokens): ``queue_full`` when MAX_QUEUE jobs are
        held, ``tenant_queue_full`` (429, Retry-After from the tenant's own work at the
        measured rate) when the tenant's held jobs reach ``embeddings_tenant_jobs`` or their
        tokens not yet embedded plus ``n_tokens`` would pass EMBEDDINGS_TENANT_TOKENS. A
        tenant holding nothing is never refused for tokens (one job is at most
        MAX_EMBEDDING_TOKENS)."""
        self._embedding_queue.check_room(scope, n_tokens)

    def submit_embeddings(self, request_id: str, inputs: list[list[int]],
                          done: Callable[[list[Any] | None, BaseException | None], None],
                          deadline: float | None = None, scope: str = "") -> None:
        """Queue an embeddings job for the loop thread: ``done(vectors, None)`` with one
        normalized float32 vector per input in order, or ``done(None, refusal)``: a cancel,
        the deadline, a failed decode (``engine_error`` naming the input and the cause), a
        stop; past any work, the refusal's ``usage`` holds the tokens embedded. Tenants
        take turns by decode, at most the embedder's ``n_batch`` tokens each
        (``embed_batch.py``), and generation and embeddings take turns by time;
        ``deadline``: unix seconds. Refused as ``check_embeddings_room`` says."""
        self._embedding_queue.submit(request_id, inputs, done, deadline, scope)

    @_native_call
    def prompt_text(self, prompt: str | list[int] | None) -> str:
        """A completion's prompt as text (``echo``): the string, or its token ids' pieces
        (control tokens render as nothing)."""
        if isinstance(prompt, str):
            return prompt
        if not isinstance(prompt, list) or not all(
                type(t) is int and 0 <= t < self.engine.n_vocab for t in prompt):
            raise InvalidParameter("prompt", "token ids must be within the vocabulary")
        raw = b"".join(self.engine.token_bytes(t) for t in prompt)
        return raw.decode("utf-8", errors="replace")

    # MAX_VOCAB_ANSWER_BYTES (from_settings): a tokenize/detokenize answer's JSON at most
    max_answer_bytes: int = 2**20

    @_native_call
    def vocabulary_answer(self, kind: str, prompt: Any, options: Any, messages: Any = None,
                          tools: Any = None) -> tuple[dict[str, Any], int]:
        """A tokenize or detokenize job's answer, from the model's vocabulary alone (no slot,
        no decode), and the tokens it counted (the request's usage: the text's tokens, or
        the ids). ``InvalidParameter`` names a field whose wire shape is wrong or whose ids
        the vocabulary does not hold. An answer whose JSON (as the web sends it) would pass
        ``max_answer_bytes`` is refused naming the input field and the limit, its counted
        tokens as the refusal's ``usage``; ``with_pieces`` is refused from the token count
        alone, before a piece is looked up, when even the shortest pieces could not fit.
        A tokenize job of chat ``messages`` (and ``tools``, for a template that renders them)
        instead of text is answered ``{"input_tokens"}``: its prompt rendered and tokenized
        as a chat job's is (``prompt_tokens``), counted (Anthropic's count_tokens)."""
        options = options if isinstance(options, dict) else {}
        if kind == protocol.TOKENIZE_KIND and messages is not None:
            if prompt is not None:
                raise InvalidParameter("prompt", "give exactly one of prompt or messages")
            tokens = self.prompt_tokens(None, messages, tool_spec(tools))
            return {"input_tokens": len(tokens)}, len(tokens)
        if kind == protocol.TOKENIZE_KIND:
            if not isinstance(prompt, str):
                raise InvalidParameter("content", "must be a string")
            add_special, with_pieces = options.get("add_special"), options.get("with_pieces")
            if not isinstance(add_special, bool) or not isinstance(with_pieces, bool):
                raise InvalidParameter("add_special", "add_special and with_pieces must be "
                                       "true or false")
            self._check_size(_utf8_len(prompt, "content"), "content")
            try:
                tokens = self.engine.tokenize(prompt, add_special=add_special) if prompt else []
            except UnicodeEncodeError:
                raise InvalidParameter("content", "is not valid UTF-8 text") from None
            if not with_pieces:
                answer: dict[str, Any] = {"tokens": tokens}
            else:
                self._check_answer(_least_pieces_bytes(len(tokens)), "content", len(tokens),
                                   at_least=True)
                answer = {"tokens": [{"id": t, "piece": _piece(self.engine.token_bytes(t))}
                                     for t in tokens]}
            self._check_answer(_json_bytes(answer), "content", len(tokens))
            return answer, len(tokens)
        if not isinstance(prompt, list) or len(prompt) > protocol.MAX_DETOKENIZE_TOKENS:
            raise InvalidParameter("tokens", f"must be a list of at most "
                                   f"{protocol.MAX_DETOKENIZE_TOKENS} token ids")
        if not all(type(t) is int and 0 <= t < self.engine.n_vocab for t in prompt):
            raise InvalidParameter("tokens", f"token ids must be within the vocabulary "
                                   f"(0 to {self.engine.n_vocab - 1})")
        raw = b"".join(self.engine.token_bytes(t) for t in prompt)
        answer = {"content": raw.decode("utf-8", errors="replace")}
        self._check_answer(_json_bytes(answer), "tokens", len(prompt))
        return answer, len(prompt)

    def _check_answer(self, n_bytes: int, field: str, n_tokens: int,
                      at_least: bool = False) -> None:
        limit = self.max_answer_bytes
        if n_bytes <= limit:
            return
        hint = "send less content, or with_pieces false" if field == "content" else \
            "send fewer token ids"
        raise Refusal(
            errors.INVALID_REQUEST_ERROR,
            f"{field}: the answer would be {'at least ' if at_least else ''}{n_bytes} bytes "
            f"of JSON, more than the limit of {limit} (MAX_VOCAB_ANSWER_BYTES): {hint}",
            param=field,
            answer_bytes=n_bytes,
            max_answer_bytes=limit,
            usage=protocol.usage(n_tokens, 0, 0),  # billed (the work was done); not shown
        )

    def _check_size(self, n_bytes: int, field: str) -> None:
        if n_bytes > self.max_prompt_bytes:  # the web's refusal, the same way
            raise Refusal(
                errors.CONTEXT_LENGTH_EXCEEDED,
                f"{field}: the prompt text is {n_bytes} bytes, more than the limit of "
                f"{self.max_prompt_bytes} (MAX_PROMPT_BYTES)",
                param=field,
                prompt_bytes=n_bytes,
                max_prompt_bytes=self.max_prompt_bytes,
            )

    def _tokenize(self, text: str, field: str, add_special: bool = True) -> list[int]:
        try:
            return self.engine.tokenize(text, add_special=add_special)
        except UnicodeEncodeError:
            raise InvalidParameter(field, "is not valid UTF-8 text") from None

    def cancel(self, request_id: str) -> bool:
        """Cancel a request wherever it is; it ends with finish_reason ``cancelled``. Never
        waits for the scheduler's lock (the cancel and watch threads call this while the
        loop may be stuck holding it): a cancel that finds it taken applies at the next
        plan, and counts as known."""
        choices = self._choices.cancel(request_id)
        if choices is not None:
            return choices
        known = self.scheduler.cancel(request_id, block=False)
        return self._embedding_queue.cancel(request_id) or known is not False

    def snapshot(self) -> dict[str, Any]:
        """The scheduler's state and the loop's liveness, without waiting on a stuck loop:
        when the scheduler's lock stays taken, its last state is shown, marked stale."""
        loop = self.loop_state()
        scheduler = self.scheduler.snapshot(wait_s=SNAPSHOT_LOCK_WAIT_S)
        if scheduler is None:
            scheduler = {**self._last_scheduler_snapshot, "stale": True}
        else:
            self._last_scheduler_snapshot = scheduler
        return {**scheduler, "embeddings": self.embeddings, "loop": loop,
                # the chat's tool-call format through the template (None: the generic
                # prompt), the default system prompt (the catalog's): what the web reads
                "chat_tools": self.chat.tools_family,
                "default_system_prompt": self.chat.default_system,
                "adapters": self.adapters.summary(wait_s=SNAPSHOT_LOCK_WAIT_S)}

    def loop_state(self) -> dict[str, Any]:
        """The loop's turns, seconds since its last one, and whether it looks stuck."""
        state, turns, _at, _call, _sample = self.clock.read()
        stalled = self.clock.stalled_s()
        calling = self.clock.calling_s()
        loop_stuck = stalled is not None and stalled > self.stuck_after_s
        call_stuck = calling is not None and calling > self.stuck_after_s
        stuck = loop_stuck or call_stuck
        # whom a hang is blamed on: the request whose sampler the stuck loop is in, else the
        # job whose native call off the loop is stuck (None: not one request's doing)
        culprit = self.scheduler.sampling if loop_stuck else None
        if culprit is None and call_stuck and not loop_stuck:
            culprit = self.clock.oldest_call_job()
        return {"turns": turns, "stalled_s": None if stalled is None else round(stalled, 2),
                "stuck": stuck, "running": state == RUNNING,
                "longest_turn_s": round(self.longest_turn_s, 3),
                # the oldest call into llama.cpp for a job off the loop (preparer, vocabulary)
                "calling_s": None if calling is None else round(calling, 2),
                # stuck in one request's sampler: that request's job id (a choice's parent)
                "stuck_on": culprit.split("#", 1)[0] if culprit else None}

    def _log_slow_turn(self, seconds: float) -> None:
        """What a long loop turn did (the supervisor's watchdog kills at TICK_DEADLINE_S)."""
        plan, stats = self.scheduler.last_plan, self._last_tick_stats
        log.warning(
            "a loop turn took %.1f s; its tick %s: %s tokens (%s prefill), %s KV retries, last "
            "decode %s ms, admitted %d, resumed %d, preempted %d", seconds,
            plan.tick if plan else "-", stats.batch_tokens if stats else "-",
            stats.prefill_tokens if stats else "-", stats.kv_retries if stats else "-",
            stats.eval_ms if stats else "-", len(plan.admitted) if plan else 0,
            len(plan.resumed) if plan else 0, len(plan.preempted) if plan else 0)

    def _tick(self, stats: TickStats) -> None:
        self._last_tick_stats = stats
        for listener in self.tick_listeners:
            listener(stats)

    def _dispatch(self, event: Event) -> None:
        """Scheduler callback (its lock held): the request's handle, then every listener."""
        if event.request_id in self._choices.siblings:  # a choice of a group in flight
            merged = self._choices.merge(event)
            if merged is None:
                return
            event = merged
        handle = self._handles.get(event.request_id)
        if isinstance(event, FinishedEvent):
            self._handles.pop(event.request_id, None)
        if handle is not None:
            handle._events.put(event)
        for listener in self.listeners:
            listener(event)


def _standin_engine(target: str, n_ctx: int, n_batch: int, n_seq_max: int,
                    rate: float) -> Any:
    """The engine ``ENGINE_STANDIN`` names ("module:factory"; a benchmark's, never the
    default), called with the context's sizes and ``ENGINE_STANDIN_RATE``."""
    import importlib

    module, _, factory = target.partition(":")
    log.warning("ENGINE_STANDIN=%s: a stand-in engine at %.1f ticks/s, no model", target, rate)
    return getattr(importlib.import_module(module), factory)(n_ctx, n_batch, n_seq_max, rate)


def _check_choices(n: Any, prompt: Any, messages: Any, prompts: Any,
                   continuation: Continuation | None) -> None:
    """``enqueue``'s choices: ``n`` within MAX_CHOICES, a list of prompts instead of
    ``prompt`` and ``messages`` and within MAX_CHOICES with ``n``, and no continuation of a
    request of several choices."""
    if type(n) is not int or not 1 <= n <= protocol.MAX_CHOICES:
        raise InvalidParameter("n", f"must be an integer from 1 to {protocol.MAX_CHOICES}")
    if prompts is not None:
        if (not isinstance(prompts, list) or not prompts or prompt is not None
                or messages is not None or len(prompts) * n > protocol.MAX_CHOICES):
            raise InvalidParameter("prompt", f"a list of prompts gives at most "
                                   f"{protocol.MAX_CHOICES} choices (prompts x n)")
    if (n > 1 or prompts is not None) and continuation is not None:
        raise InvalidParameter("n", "a request of several choices cannot be continued")


def _piece(raw: bytes) -> str | list[int]:
    """A token's piece as llama-server's ``with_pieces`` gives it: its text, or its bytes
    when they are not UTF-8 on their own (a part of a character)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


# The JSON the web answers with (Django's JsonResponse: json.dumps' defaults, ASCII with
# escapes, ", " and ": " between items)
_PIECES_FRAME = len(json.dumps({"tokens": []}))
_LEAST_PIECE = len(json.dumps({"id": 0, "piece": ""})) + len(", ")


def _json_bytes(answer: dict[str, Any]) -> int:
    """The answer's size as the web's JSON body."""
    return len(json.dumps(answer))


def _least_pieces_bytes(n_tokens: int) -> int:
    """The fewest bytes a with_pieces answer of ``n_tokens`` can take (one-digit ids, empty
    pieces): more than the cap refuses it before any piece is looked up."""
    return _PIECES_FRAME + max(0, n_tokens * _LEAST_PIECE - len(", "))


def _utf8_len(text: str, field: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidParameter(field, "is not valid UTF-8 text (a lone surrogate?)") from None
