"""Adapter groups in the scheduler, and the adapter registry's loading policy, on the fake
engine (no model; tests/scheduler/test_adapters_engine.py runs the same on Gemma): one
group's rows per decode, the context's adapter set switched only between groups, turns
round-robin between groups, adapters freed only when no request holds them and the
context no longer applies them, a cap on loaded adapters, a tenant's eviction reaching
its adapters' scopes."""

from __future__ import annotations

import os

import pytest

from scheduler_daemon.core import adapters as adapters_module
from scheduler_daemon.core.adapters import AdapterRegistry, AdapterUse, scoped
from scheduler_daemon.core.state import Request
from wire.errors import Refusal
from wire.sampling import SamplingParams

from .fake_engine import FakeEngine


def use(adapter_id: str, scale: float = 1.0) -> AdapterUse:
    return AdapterUse(adapter_id, scale, f"lora:{adapter_id}@{scale!r}", f"handle:{adapter_id}")


def req(rid: str, adapter: AdapterUse | None = None, prompt: int = 4, max_tokens: int = 6,
        scope: str = "T") -> Request:
    return Request(id=rid, prompt_tokens=list(range(10, 10 + prompt)),
                   params=SamplingParams(max_tokens=max_tokens), cache_scope=scoped(scope, adapter),
                   cache_prompt=False, adapter=adapter)


def groups_of(h) -> list[set[str]]:
    """Per decoded tick, the groups of its rows."""
    return [{r.request.group for r in plan.rows} for plan in h.plans if plan.rows]


def test_one_group_per_decode_and_the_context_applies_its_adapter(harness):
    h = harness(FakeEngine(n_seq_max=6), max_queue=16)
    a, b = use("ad_a"), use("ad_b", 0.5)
    for rid, adapter in [("base1", None), ("a1", a), ("b1", b), ("a2", a), ("base2", None)]:
        h.scheduler.submit(req(rid, adapter))
    h.run()
    assert all(len(g) == 1 for g in groups_of(h))  # never two groups in one decode
    for plan, applied in zip([p for p in h.plans if p.rows], h.engine.decode_adapters,
                             strict=True):
        [group] = {r.request.group for r in plan.rows}
        expected = {"": [], a.group: [(a.handle, 1.0)], b.group: [(b.handle, 0.5)]}[group]
        assert applied == expected
    for rid in ("base1", "a1", "b1", "a2", "base2"):
        assert h.finished(rid).finish_reason == "length"


def test_groups_take_turns_a_flood_on_one_adapter_delays_the_base_by_one_turn(harness):
    h = harness(FakeEngine(n_ctx=8192, n_seq_max=8), max_queue=32)
    flood = use("ad_flood")
    for i in range(6):
        h.scheduler.submit(req(f"f{i}", flood, max_tokens=20, scope="F"))
    for _ in range(3):
        h.step()
    h.scheduler.submit(req("base", None, max_tokens=6, scope="B"))
    ticks_until_done = 0
    while h.finished("base") is None:
        h.step()
        ticks_until_done += 1
    turns = [g for g in groups_of(h)[3:]]
    # from its arrival the base group decodes every other tick: one flood turn between two
    base_ticks = [i for i, g in enumerate(turns) if g == {""}]
    assert base_ticks and all(b - a == 2 for a, b in zip(base_ticks, base_ticks[1:], strict=False))
    assert base_ticks[0] <= 1  # its first turn is this tick or the next
    assert ticks_until_done <= 2 * len(base_ticks)  # prefill + 6 tokens, each a turn apart
    h.run()


def test_switching_happens_only_between_groups(harness):
    h = harness(FakeEngine(n_seq_max=4), max_queue=8)
    a = use("ad_a")
    h.scheduler.submit(req("a1", a, max_tokens=10))
    h.scheduler.submit(req("a2", a, max_tokens=10))
    h.run()
    assert h.scheduler.counters["adapter_switches"] == 1  # on once, never again
    assert h.scheduler.group_tokens[a.group] > 0


class FakeLoads:
    """The registry's file checks replaced (pure policy): every file passes, its hash is its
    name's."""

    def __init__(self, monkeypatch) -> None:
        monkeypatch.setattr(adapters_module, "read_shapes", lambda path: ("gemma3", {}))
        monkeypatch.setattr(adapters_module, "check_adapter", lambda path, base: None)
        monkeypatch.setattr(adapters_module, "_sha256", lambda path: "0" * 64)
        real = adapters_module.AdapterRegistry._private_copy
        # paths that do not exist (pure policy) are taken as they are; real files are copied
        monkeypatch.setattr(adapters_module.AdapterRegistry, "_private_copy",
                            lambda self, path: real(self, path) if os.path.lexists(path)
                            else path)


def registry_on(h, max_loaded: int = 4, **kw) -> AdapterRegistry:
    """An adapter registry over the harness's engine and scheduler."""
    registry = AdapterRegistry(h.engine, "base.gguf", max_loaded, h.scheduler.adapters_in_use,
                               **kw)
    h.scheduler.adapters = registry
    return registry


def spec(adapter_id: str, scale: float = 1.0) -> dict:
    return {"id": adapter_id, "path": f"/adapters/{adapter_id}.gguf", "sha256": "0" * 64,
            "scale": scale}


def test_the_registry_loads_once_keeps_a_cap_and_frees_only_what_no_request_holds(
        harness, monkeypatch):
    FakeLoads(monkeypatch)
    h = harness(FakeEngine(n_seq_max=4), max_queue=8)
    engine = h.engine
    registry = AdapterRegistry(engine, "base.gguf", 2, h.scheduler.adapters_in_use)
    h.scheduler.adapters = registry

    def submit(rid: str, adapter_id: str) -> None:
        with registry.hold(spec(adapter_id)) as u:
            h.scheduler.submit(req(rid, u, max_tokens=3))

    submit("a1", "ad_a")
    submit("a2", "ad_a")
    submit("b1", "ad_b")
    assert engine.loaded == ["/adapters/ad_a.gguf", "/adapters/ad_b.gguf"]  # a once
    with pytest.raises(Refusal) as refused:  # two loaded, both held by queued requests
        submit("c1", "ad_c")
    assert refused.value.code == "adapters_busy"
    h.run()  # a and b finish: nothing holds them
    submit("c1", "ad_c")  # the least recently used (a) makes room
    h.step()  # a is freed before the tick decodes, off the context first
    assert engine.freed == ["handle:/adapters/ad_a.gguf"]
    assert registry.summary()["loaded"] == ["ad_b", "ad_c"]
    h.run()
    assert registry.unloads["ad_a"] == 1 and registry.loads["ad_c"] == 1
    assert registry.tokens["ad_c"] > 0


def test_a_deleted_adapter_is_unloaded_when_its_requests_end_and_never_loaded_again(
        harness, monkeypatch):
    FakeLoads(monkeypatch)
    h = harness(FakeEngine(n_seq_max=4), max_queue=8)
    registry = registry_on(h, 4)
    with registry.hold(spec("ad_a")) as u:
        h.scheduler.submit(req("a1", u, max_tokens=5))
    h.step()
    h.step()
    registry.delete("ad_a")
    h.step()
    assert h.engine.freed == []  # a1 still runs under it
    h.run()
    h.scheduler.schedule()  # the next tick frees it
    assert h.engine.freed == ["handle:/adapters/ad_a.gguf"]
    assert h.finished("a1").finish_reason == "length"
    with pytest.raises(Refusal) as refused:
        with registry.hold(spec("ad_a")):
            pass
    assert refused.value.code == "model_not_found"  # as the web answers a deleted one


def test_a_file_that_is_not_the_registered_one_is_refused_before_llama_cpp_sees_it(
        harness, monkeypatch, tmp_path):
    monkeypatch.setattr(adapters_module, "read_shapes", lambda path: ("gemma3", {}))
    checked = []
    monkeypatch.setattr(adapters_module, "check_adapter", lambda path, base: checked.append(path))
    h = harness(FakeEngine(n_seq_max=4), max_queue=8)
    registry = registry_on(h, 4)
    path = tmp_path / "a.gguf"
    path.write_bytes(b"an adapter that passes the check, changed since it was registered")
    with pytest.raises(Refusal) as refused:
        with registry.hold({**spec("ad_a"), "path": str(path)}):  # registered: "0" * 64
            pass
    assert refused.value.code == "adapter_unusable"
    assert len(checked) == 1 and h.engine.loaded == []  # checked, then refused by the hash
    assert checked[0] != str(path)  # what is checked is the private copy, not the path


def test_a_fifo_a_link_and_a_file_outside_the_folder_are_refused_without_waiting(
        harness, monkeypatch, tmp_path):
    FakeLoads(monkeypatch)
    h = harness(FakeEngine(n_seq_max=4), max_queue=8)
    root = tmp_path / "adapters"
    root.mkdir()
    registry = registry_on(h, 4, root=str(root))
    fifo = root / "fifo.gguf"
    os.mkfifo(fifo)  # an open() that blocked would hang this test
    outside = tmp_path / "outside.gguf"
    outside.write_bytes(b"x")
    link = root / "link.gguf"
    link.symlink_to(root / "real.gguf")
    (root / "real.gguf").write_bytes(b"x")
    for path in (fifo, outside, link):
        with pytest.raises(Refusal) as refused:
            with registry.hold({**spec("ad_a"), "path": str(path)}):
                pass
        assert refused.value.code == "adapter_unusable"
    assert h.engine.loaded == []
    with registry.hold({**spec("ad_a"), "path": str(root / "real.gguf")}):
        pass  # the same file by its own name loads
    assert len(h.engine.loaded) == 1


def test_a_load_that_llama_cpp_refuses_is_adapter_unusable_and_evicts_nothing(
        harness, monkeypatch):
    FakeLoads(monkeypatch)
    h = harness(FakeEngine(n_seq_max=4), max_queue=8)
    registry = registry_on(h, 1)
    monkeypatch.setattr(adapters_module.AdapterRegistry, "_private_copy",
                        lambda self, path: path)
    with registry.hold(spec("ad_a")):
        pass

    def refuse(path):
        raise RuntimeError("llama.cpp refused the adapter")  # EngineError is a RuntimeError

    monkeypatch.setattr(h.engine, "load_adapter", refuse)
    with pytest.raises(Refusal) as refused:
        with registry.hold(spec("ad_b")):
            pass
    assert refused.value.code == "adapter_unusable"
    assert registry.summary()["loaded"] == ["ad_a"]  # a stays: no room was made for b


def test_a_tenants_eviction_reaches_its_adapters_scopes_and_no_one_elses(harness):
    h = harness(FakeEngine(n_seq_max=4), max_queue=8, cache_prompt=True)
    a = use("ad_a")
    for rid, adapter, scope in [("t", None, "T"), ("ta", a, "T"), ("other", None, "TT")]:
        r = req(rid, adapter, prompt=40, max_tokens=2, scope=scope)
        r.cache_prompt = True
        h.scheduler.submit(r)
    h.run()
    held = {s.scope for s in h.scheduler.slots() if s.tokens}
    assert held == {"T", scoped("T", a), "TT"}
    assert h.scheduler.evict_scope("T") == 2
    assert {s.scope for s in h.scheduler.slots() if s.tokens} == {"TT"}


def test_a_loaded_adapters_affinity_heads_are_published_until_it_is_unloaded(
        harness, monkeypatch):
    FakeLoads(monkeypatch)
    h = harness(FakeEngine(n_seq_max=4), max_queue=8)
    registry = registry_on(h, 1)
    for route in ("head-a-1.0", "head-a-0.5"):  # one head per scale (and tenant)
        with registry.hold(spec("ad_a"), route=route) as u:
            h.scheduler.submit(req(route, u, max_tokens=2))
    h.run()
    assert registry.routes() == {"head-a-1.0", "head-a-0.5"}
    assert registry.take_unrouted() == []  # loaded: its heads stay
    with registry.hold(spec("ad_b"), route="head-b") as u:  # a makes room for b
        h.scheduler.submit(req("b1", u, max_tokens=2))
    h.run()
    assert registry.routes() == {"head-b"}
    assert sorted(registry.take_unrouted()) == ["head-a-0.5", "head-a-1.0"]
    assert registry.take_unrouted() == []


def test_a_tenants_scales_and_adapters_share_one_turn_a_round(harness):
    """Scales (or adapters) of one tenant are groups of their own (one adapter set per
    decode) but one tenant's turn: three scales do not get three turns to the base's one."""
    h = harness(FakeEngine(n_ctx=8192, n_seq_max=8), max_queue=32)
    for i, scale in enumerate((1.0, 0.5, 0.25)):
        for j in range(2):
            h.scheduler.submit(req(f"t{i}{j}", use("ad_t", scale), max_tokens=30, scope="T"))
    h.scheduler.submit(req("base", None, max_tokens=12, scope="B"))
    while h.finished("base") is None:
        h.step()
    turns = [g for g in groups_of(h)]
    base_ticks = [i for i, g in enumerate(turns) if g == {""}]
    assert all(b - a == 2 for a, b in zip(base_ticks, base_ticks[1:], strict=False)), turns
    assert len({next(iter(g)) for g in turns if g != {""}}) == 3  # the scales rotate
    h.run()


def test_a_tenants_queue_cap_counts_every_adapter_and_scale(harness):
    h = harness(FakeEngine(n_seq_max=2), max_queue=32, max_queue_per_scope=2)
    h.scheduler.submit(req("a", use("ad_t", 1.0), scope="T"))
    h.scheduler.submit(req("b", use("ad_t", 0.5), scope="T"))
    with pytest.raises(Refusal) as refused:
        h.scheduler.submit(req("c", use("ad_u", 0.25), scope="T"))
    assert refused.value.code == "tenant_queue_full"
    h.scheduler.submit(req("d", None, scope="U"))  # another tenant queues on


def test_the_ram_tiers_tenant_share_counts_every_adapter_scope_of_the_tenant():
    from scheduler_daemon.core.ram_cache import RamCache

    ram = RamCache(1000, tenant_share=0.5)
    ram.add("U", [1], "u", 100, now=0.0)  # another tenant: the share applies
    for i, scale in enumerate((1.0, 0.5, 0.25)):
        scope = scoped("T", use("ad_t", scale))
        evicted, room = ram.make_room(scope, [i], 200)
        assert room and len(evicted) == (i == 2)  # the third makes room in T's own 500
        ram.add(scope, [i], "t", 200, now=0.0)
    assert ram.scope_bytes("T") == 400 == ram.scope_bytes(scoped("T", use("ad_t", 9.0)))
    assert ram.scope_bytes("U") == 100  # the other tenant's entry stays


def test_no_tenant_holds_more_than_half_the_loaded_adapters(harness, monkeypatch):
    FakeLoads(monkeypatch)
    h = harness(FakeEngine(n_seq_max=8), max_queue=16)
    registry = registry_on(h, 4)

    def submit(rid: str, adapter_id: str, tenant: str) -> None:
        with registry.hold(spec(adapter_id), tenant=tenant) as u:
            h.scheduler.submit(req(rid, u, max_tokens=3, scope=tenant))

    submit("t1", "ad_t1", "T")
    submit("t2", "ad_t2", "T")
    with pytest.raises(Refusal) as refused:  # T's two are busy: T may not take a third
        submit("t3", "ad_t3", "T")
    assert refused.value.code == "adapters_busy"
    submit("u1", "ad_u1", "U")  # another tenant still finds room
    h.run()
    submit("t3", "ad_t3", "T")  # T's own least recently used (t1) makes room
    h.step()
    assert sorted(registry.summary()["loaded"]) == ["ad_t2", "ad_t3", "ad_u1"]
    h.run()


def one_group_per_decode(h) -> list[set[str]]:
    """Record the groups of every decode call (failed ones too) as they happen."""
    seen: list[set[str]] = []

    def check(rows) -> None:
        by_seq = {s.seq_id: s.request for s in h.scheduler.slots()}
        seen.append({by_seq[r.seq_id].group for r in rows})
        assert len(seen[-1]) == 1, seen[-1]

    h.engine.on_decode = check
    return seen


def test_a_kv_pressure_replan_keeps_its_groups_rows_apart(harness):
    h = harness(FakeEngine(n_ctx=1024, n_batch=256, n_seq_max=4, kv_cells=150), max_queue=8,
                chunk_size=256, kv_block_tokens=16)
    seen = one_group_per_decode(h)
    a = use("ad_a")
    h.scheduler.submit(req("a1", a, prompt=60, max_tokens=10))
    h.scheduler.submit(req("a2", a, prompt=60, max_tokens=10))
    h.scheduler.submit(req("b1", None, prompt=60, max_tokens=10, scope="B"))
    h.run()
    assert h.scheduler.counters["kv_pressure"] > 0  # re-planned under pressure
    assert {frozenset(g) for g in seen} == {frozenset({a.group}), frozenset({""})}
    assert all(h.finished(r) is not None for r in ("a1", "a2", "b1"))


def test_a_preempted_adapter_request_resumes_under_its_adapter(harness):
    h = harness(FakeEngine(n_ctx=4096), preempt_min_tokens=8, max_queue=8)
    seen = one_group_per_decode(h)
    a = use("ad_a")
    for i in range(4):
        h.scheduler.submit(req(f"a{i}", a, prompt=8, max_tokens=40, scope="A"))
    for _ in range(10):
        h.step()
    h.scheduler.submit(req("b0", None, prompt=8, max_tokens=4, scope="B"))
    h.run()
    preempted = [rid for plan in h.plans for rid in plan.preempted]
    resumed = [rid for plan in h.plans for rid in plan.resumed]
    assert preempted == resumed == ["a3"]
    back = next(i for i, plan in enumerate(h.plans) if "a3" in plan.resumed)
    refill = next(p for p in h.plans[back:] if "a3" in p.request_ids)
    assert refill.group == a.group and refill.adapter_set == [(a.handle, 1.0)]
    assert all(len(g) == 1 for g in seen)
    assert h.finished("a3").stats.completion_tokens == 40


def test_within_a_round_prefills_go_in_arrival_order_and_no_unit_goes_twice(harness):
    h = harness(FakeEngine(n_ctx=8192, n_seq_max=8), max_queue=32)
    a, b, c = use("ad_a"), use("ad_b"), use("ad_c")
    h.scheduler.submit(req("c1", c, max_tokens=8, scope="C"))  # c's arrives first
    h.scheduler.submit(req("a1", a, max_tokens=8, scope="A"))
    h.scheduler.submit(req("b1", b, max_tokens=8, scope="B"))
    h.scheduler.submit(req("base", None, max_tokens=8, scope="D"))
    for _ in range(4):
        h.step()
    first_round = [next(iter(g)) for g in groups_of(h)[:4]]
    assert first_round == [c.group, a.group, b.group, ""]  # the prefills by arrival
    h.run()
    turns = [next(iter(g)) for g in groups_of(h)]
    for i in range(0, len(turns) - 3, 4):  # every round: each of the four once
        assert sorted(turns[i:i + 4]) == sorted(["", a.group, b.group, c.group]), turns
