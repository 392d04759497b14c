"""Embeddings in the scheduler's loop (#16, #31), on the real engine (Gemma): bounded
decodes with the mean taken over chunks, generation and embeddings taking turns, inputs
that never overflow the embeddings context, every embeddings job ending once (answer,
cancel, deadline, a failed decode, stop) and billed for the tokens it embedded."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from scheduler_daemon.core.engine_api import normalized
from scheduler_daemon.core.inference import DEFAULT_EMBEDDINGS_TENANT_TOKENS, InferenceCore
from scheduler_daemon.core.scheduler import SchedulerConfig
from scheduler_daemon.core.state import FinishedEvent
from scheduler_daemon.llama.embedder import Embedder
from scheduler_daemon.llama.errors import EngineError
from wire import errors, protocol
from wire.errors import Refusal
from wire.sampling import SamplingParams


class Ends:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.done = threading.Event()

    def __call__(self, vectors, error) -> None:
        self.calls.append((vectors, error, time.monotonic()))
        self.done.set()


def test_an_input_over_several_decodes_gets_the_mean_of_all_its_tokens(gemma_engine):
    tokens = gemma_engine.tokenize("The history of trains and railways. " * 30)[:300]
    results = []
    for n_batch in (128, 512):  # three decodes of the input, then one
        embedder = Embedder(gemma_engine, 1024, n_batch, 4)
        total, done = None, 0
        while done < len(tokens):
            piece = tokens[done:done + embedder.n_batch]
            (chunk,) = embedder.decode([(0, piece, done)])
            total = chunk if total is None else total + chunk
            done += len(piece)
        results.append(normalized(total, done))
        embedder.close()
    chunked, whole = results
    assert np.linalg.norm(chunked) == pytest.approx(1.0, abs=1e-5)
    assert float(chunked @ whole) > 0.999  # the same mean, summed in another shape


def test_generation_is_not_starved_by_a_large_embeddings_job(core, gemma_engine):
    inputs = [gemma_engine.tokenize(f"Document {i} about the weather in spring. " * 12)[:100]
              for i in range(40)]  # 4,000 tokens: ~32 decodes of 128
    ends = Ends()
    core.submit_embeddings("big", inputs, ends)
    handle = core.submit(prompt="Once upon a time", params=SamplingParams.from_dict(
        {"max_tokens": 16, "ignore_eos": True, "temperature": 0}))
    finished = handle.result(timeout=300)
    generated_at = time.monotonic()
    assert finished.finished.stats.completion_tokens == 16
    assert ends.done.wait(300)
    vectors, error, embedded_at = ends.calls[0]
    assert error is None and len(vectors) == 40
    assert generated_at < embedded_at  # the 16 tokens did not wait for the 4,000


def test_a_cancelled_embeddings_job_ends_cancelled_once(core, gemma_engine):
    inputs = [gemma_engine.tokenize("word " * 100)[:100] for _ in range(60)]
    ends = Ends()
    core.submit_embeddings("gone", inputs, ends)
    assert core.cancel("gone")
    assert ends.done.wait(120)
    time.sleep(0.5)
    assert len(ends.calls) == 1
    vectors, error, _ = ends.calls[0]
    assert vectors is None and isinstance(error, Refusal) and error.code == errors.CANCELLED


def test_an_embeddings_job_past_its_deadline_ends_with_timeout(core, gemma_engine):
    ends = Ends()
    core.submit_embeddings("late", [gemma_engine.tokenize("x")], ends,
                           deadline=time.time() - 1)
    assert ends.done.wait(60)
    assert ends.calls[0][1].code == errors.TIMEOUT


def test_the_queue_and_the_tenant_share_are_bounded(gemma_engine):
    core = InferenceCore(gemma_engine, SchedulerConfig(max_queue=3), embeddings_tenant_jobs=2)
    ends = Ends()
    for i in range(2):
        core.submit_embeddings(f"a{i}", [[1, 2]], ends, scope="a")
    with pytest.raises(Refusal) as caught:
        core.submit_embeddings("a2", [[1, 2]], ends, scope="a")
    assert caught.value.code == errors.TENANT_QUEUE_FULL
    core.submit_embeddings("b0", [[1, 2]], ends, scope="b")
    with pytest.raises(Refusal) as caught:
        core.submit_embeddings("b1", [[1, 2]], ends, scope="b")
    assert caught.value.code == errors.QUEUE_FULL
    # never started: a stopping daemon hands them back (no end written)
    assert sorted(core.stop(grace_s=0, hand_back=True)) == ["a0", "a1", "b0"]
    assert ends.calls == []


def test_one_tenant_s_one_token_jobs_leave_the_embeddings_queue_to_others(gemma_engine):
    # #31 review: the tokens cap does not bind one-token jobs, and run_scheduler gives the
    # core a per-tenant queue cap equal to its whole queue: one tenant filled it and every
    # other tenant's embeddings got 503 queue_full
    core = InferenceCore(gemma_engine, SchedulerConfig(max_queue=64, max_queue_per_scope=64))
    assert core.embeddings_tenant_jobs == 16  # a quarter of the embeddings queue
    ends = Ends()
    for i in range(16):
        core.submit_embeddings(f"a{i}", [[5]], ends, scope="a")
    with pytest.raises(Refusal) as caught:
        core.submit_embeddings("a16", [[5]], ends, scope="a")
    assert caught.value.code == errors.TENANT_QUEUE_FULL
    assert errors.status_of(caught.value.code) == 429
    assert caught.value.details["max_queued"] == 16
    assert 1 <= caught.value.details["retry_after_s"] <= 60
    for scope in ("b", "c"):
        core.check_embeddings_room(scope)
        core.submit_embeddings(f"{scope}0", [[5]], ends, scope=scope)
    assert len(core.stop(grace_s=0, hand_back=True)) == 18
    assert ends.calls == []


def test_a_stop_without_hand_back_ends_waiting_jobs_with_shutting_down(gemma_engine):
    core = InferenceCore(gemma_engine, SchedulerConfig())
    ends = Ends()
    core.submit_embeddings("w", [[1, 2]], ends)
    assert core.stop(grace_s=0) == []
    assert ends.calls[0][1].code == errors.SHUTTING_DOWN


def test_a_failing_end_callback_does_not_fail_the_loop(core, gemma_engine):
    def broken(vectors, error):
        raise RuntimeError("the writer is gone")

    core.submit_embeddings("broken", [gemma_engine.tokenize("x y")], broken)
    handle = core.submit(prompt="Hello", params=SamplingParams.from_dict({"max_tokens": 2}))
    assert isinstance(list(handle.events(timeout=120))[-1], FinishedEvent)
    assert core.scheduler.counters["tick_failures"] == 0


def test_a_full_context_input_between_two_others_gets_all_three_vectors(core, gemma_engine):
    # #31: [[t]*100, [t]*2048, [t]*10] failed with "failed to find a memory slot for batch
    # of size 110" (the 10-token input shared a decode with the 2,048-token one's tail)
    t = gemma_engine.tokenize("cat")[-1]
    ends = Ends()
    core.submit_embeddings("fits", [[t] * 100, [t] * 2048, [t] * 10], ends)
    assert ends.done.wait(600)
    vectors, error, _ = ends.calls[0]
    assert error is None and len(vectors) == 3
    for v in vectors:
        assert np.linalg.norm(v) == pytest.approx(1.0, abs=1e-5)
    embedder = gemma_engine.embedder()
    assert embedder.cells_used == 0  # every input's cells given back


def test_the_embedder_refuses_a_decode_past_its_cells_before_llama_cpp_sees_it(gemma_engine):
    embedder = Embedder(gemma_engine, 256, 128, 4)
    try:
        embedder.decode([(0, [5] * 128, 0)])
        embedder.decode([(1, [5] * 128, 0)])
        with pytest.raises(ValueError, match="pass the context"):
            embedder.decode([(2, [5] * 10, 0)])
        with pytest.raises(ValueError, match="follow"):
            embedder.decode([(0, [5] * 10, 5)])  # a gap in sequence 0's positions
        embedder.forget(1)
        assert embedder.cells_used == 128
        embedder.decode([(2, [5] * 10, 0)])  # the cells sequence 1 gave back
    finally:
        embedder.close()


def test_a_cancel_after_work_is_billed_for_the_tokens_embedded(core, gemma_engine):
    inputs = [gemma_engine.tokenize("word " * 200)[:128] for _ in range(40)]
    ends = Ends()
    core.submit_embeddings("half", inputs, ends)
    deadline = time.monotonic() + 300
    while core._embedding_queue.batcher.find("half").embedded_tokens < 256:  # two decodes done
        assert time.monotonic() < deadline
        time.sleep(0.01)
    core.cancel("half")
    assert ends.done.wait(120)
    vectors, error, _ = ends.calls[0]
    assert vectors is None and error.code == errors.CANCELLED
    billed = error.details["usage"]["prompt_tokens"]
    assert 256 <= billed < 40 * 128 and billed % 128 == 0


def test_a_failed_decode_is_a_typed_error_naming_the_input_and_billed(core, gemma_engine,
                                                                     monkeypatch):
    embedder = gemma_engine.embedder()
    real = embedder.decode
    calls = []

    def failing(pieces):  # a stand-in failure of llama.cpp at the second decode
        calls.append(pieces)
        if len(calls) == 2:
            raise EngineError("llama_decode of an embeddings batch returned -3")
        return real(pieces)

    monkeypatch.setattr(embedder, "decode", failing)
    ends = Ends()
    core.submit_embeddings("broken", [[5] * 100, [6] * 100], ends)
    assert ends.done.wait(120)
    vectors, error, _ = ends.calls[0]
    assert vectors is None and isinstance(error, Refusal)
    assert error.code == errors.ENGINE_ERROR and errors.status_of(error.code) == 500
    assert error.param == "input[1]" and "returned -3" in error.message  # the open one
    assert error.details["usage"] == protocol.usage(128, 0, 0)  # the first decode's tokens
    monkeypatch.undo()
    assert embedder.cells_used == 0
    ends = Ends()
    core.submit_embeddings("after", [[5] * 100], ends)  # the context is usable again
    assert ends.done.wait(120) and ends.calls[0][1] is None


def test_a_tenant_s_embeddings_work_in_flight_is_capped(gemma_engine):
    core = InferenceCore(gemma_engine, SchedulerConfig(max_queue=16),
                         embeddings_tenant_tokens=3000)
    ends = Ends()
    core.submit_embeddings("a0", [[5] * 2000], ends, scope="a")
    with pytest.raises(Refusal) as caught:
        core.submit_embeddings("a1", [[5] * 1001], ends, scope="a")
    assert caught.value.code == errors.TENANT_QUEUE_FULL
    assert errors.status_of(caught.value.code) == 429
    assert 1 <= caught.value.details["retry_after_s"] <= 60
    core.submit_embeddings("a2", [[5] * 1000], ends, scope="a")  # within the 3,000
    core.submit_embeddings("b0", [[5] * 2000], ends, scope="b")  # another tenant's own share
    with pytest.raises(Refusal):
        core.check_embeddings_room("a")  # before tokenizing: already at the cap
    lone = InferenceCore(gemma_engine, SchedulerConfig(), embeddings_tenant_tokens=10)
    lone.submit_embeddings("big", [[5] * 2048], ends, scope="a")  # one job always fits
    assert DEFAULT_EMBEDDINGS_TENANT_TOKENS == 2 * protocol.MAX_EMBEDDING_TOKENS
    assert sorted(core.stop(grace_s=0, hand_back=True)) == ["a0", "a2", "b0"]
    assert lone.stop(grace_s=0, hand_back=True) == ["big"]


def test_three_tenants_long_inputs_at_once_never_pass_the_context(core, gemma_engine):
    # tenants take turns by decode, so all three inputs would be open together: 4,500
    # tokens for a context of 4,096 cells unless an input begins only when it fits whole
    t = gemma_engine.tokenize("cat")[-1]
    ends = Ends()
    for scope in ("a", "b", "c"):
        core.submit_embeddings(f"long-{scope}", [[t] * 1500], ends, scope=scope)
    deadline = time.monotonic() + 600
    while len(ends.calls) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert [error for _, error, _ in ends.calls] == [None, None, None]
    assert gemma_engine.embedder().n_ctx == 4096
