"""The daemon's probe for bench/ttft_phases.py (on PYTHONPATH of the daemon it starts, never
of the service): when ``$PROBE_DAEMON_FILE`` is set, the intake's and the scheduler's steps
are wrapped as their modules are imported, and each step's wall-clock time is written as a
JSON line (by jobs-stream entry or request id). When ``$PROBE_STEAL_FILE`` is set (for
bench/prefill_steal.py), the decode of each tick that admits a request is wrapped: what
every other task ran meanwhile. Only this project's own classes are wrapped."""
from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time
from typing import Any

_PROBES: dict[str, list[Any]] = {}  # module name -> what wraps it once it is imported

if os.environ.get("PROBE_DAEMON_FILE"):
    _out = open(os.environ["PROBE_DAEMON_FILE"], "a", buffering=1)  # noqa: SIM115
    _lock = threading.Lock()

    def _emit(record: dict[str, Any]) -> None:
        with _lock:
            _out.write(json.dumps(record) + "\n")

    def _probe_intake(module: Any) -> None:
        cls = module.Intake
        wait, read, start = cls._wait_for_work, cls._read, cls._start_job
        local = threading.local()

        def probed_wait(self: Any) -> None:
            wait(self)
            local.bell = time.time()

        def probed_read(self: Any, count: int) -> Any:
            t0 = time.time()
            entries = read(self, count)
            t1 = time.time()
            for entry_id, _ in entries:
                _emit({"eid": module.as_text(entry_id), "bell": getattr(local, "bell", 0.0),
                       "take_start": t0, "take_end": t1})
            return entries

        def probed_start(self: Any, entry_id: str, job: Any, takeover: Any) -> Any:
            _emit({"eid": entry_id, "rid": job.id, "start": time.time()})
            checks, enqueue = self._while_redis_away, self.core.enqueue

            def probed_checks(call: Any) -> Any:
                result = checks(call)
                _emit({"rid": job.id, "checks_end": time.time()})
                return result

            def probed_enqueue(*args: Any, **kwargs: Any) -> Any:
                _emit({"rid": job.id, "core_start": time.time()})
                result = enqueue(*args, **kwargs)
                _emit({"rid": job.id, "core_end": time.time()})
                return result

            self._while_redis_away, self.core.enqueue = probed_checks, probed_enqueue
            try:
                return start(self, entry_id, job, takeover)
            finally:
                del self._while_redis_away, self.core.enqueue

        cls._wait_for_work, cls._read, cls._start_job = probed_wait, probed_read, probed_start

    def _probe_scheduler(module: Any) -> None:
        schedule = module.Scheduler.schedule

        def probed_schedule(self: Any) -> Any:
            plan = schedule(self)
            now = time.time()
            for request_id in plan.admitted:
                _emit({"rid": request_id, "planned": now})
            return plan

        module.Scheduler.schedule = probed_schedule

    _PROBES.setdefault("scheduler_daemon.intake", []).append(_probe_intake)
    _PROBES.setdefault("scheduler_daemon.scheduler", []).append(_probe_scheduler)

if os.environ.get("PROBE_STEAL_FILE"):
    # Around the decode of each tick that admits a request (its prefill): every task's time
    # on a CPU and time runnable but waiting for one (``/proc/<pid>/task/<tid>/schedstat``,
    # ns) in the daemon, its supervisor, daphne, redis-server and the client, by component.
    # Read before and after the decode (not during it: the reads delay the prefill, they do
    # not load it); the commit after it (the first token's events) is outside.
    _steal_out = open(os.environ["PROBE_STEAL_FILE"], "a", buffering=1)  # noqa: SIM115
    _pids: dict[str, list[int]] = {}

    def _find(marker: bytes) -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if marker in f.read():
                            found.append(int(entry))
                except OSError:
                    pass
        return found

    def _processes() -> dict[str, list[int]]:
        if not _pids:
            web = os.environ.get("PROBE_WEB_MARKER", "daphne").encode()  # its port
            _pids.update(web=_find(web), redis=_find(b"redis-server"),
                         supervisor=[os.getppid()],
                         client=[int(os.environ.get("PROBE_CLIENT_PID") or 0)])
        return _pids

    def _sched() -> dict[tuple[int, int], tuple[int, int, int, int]]:
        """Per task: ns on a CPU, ns runnable but waiting, times it got a CPU, and (for the
        daemon's own threads, from ``/proc/.../sched``) times it moved to another CPU."""
        out = {}
        own = os.getpid()
        for pid in [own] + [p for pids in _processes().values() for p in pids]:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        run_ns, wait_ns, slices = f.read().split()
                    moves = 0
                    if pid == own:
                        with open(f"/proc/{pid}/task/{tid}/sched") as f:
                            moves = next(int(line.split()[-1]) for line in f
                                         if line.startswith("se.nr_migrations"))
                except (OSError, ValueError, StopIteration):
                    continue
                out[(pid, int(tid))] = (int(run_ns), int(wait_ns), int(slices), moves)
        return out

    def _machine() -> tuple[int, int]:
        """The machine's busy and steal time so far (``/proc/stat``, ms; 10 ms ticks)."""
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...
        return (sum(fields[:3]) + sum(fields[5:8])) * 10, fields[7] * 10

    def _component(pid: int, tid: int, loop_tid: int, names: dict[int, str]) -> str:
        if pid == os.getpid():
            if tid == loop_tid:
                return "engine:loop"
            return f"daemon:{names[tid]}" if tid in names else "engine:native"
        return next((name for name, pids in _processes().items() if pid in pids), "other")

    _admitting = threading.local()  # the loop thread's tick admits these requests

    def _probe_steal(module: Any) -> None:
        run = module.Scheduler.run

        def probed_run(self: Any, plan: Any) -> Any:
            _admitting.rids = list(plan.admitted)
            try:
                return run(self, plan)
            finally:
                _admitting.rids = []

        module.Scheduler.run = probed_run

    def _probe_decode(module: Any) -> None:
        decode = module.LlamaEngine.decode

        def probed_decode(self: Any, rows: Any, abortable: bool = False) -> Any:
            rids = getattr(_admitting, "rids", None)
            if not rids:
                return decode(self, rows, abortable)
            _admitting.rids = []  # its first decode only (a retry is another story)
            before, busy0, t0 = _sched(), _machine(), time.monotonic()
            result = decode(self, rows, abortable)
            wall, busy1, after = time.monotonic() - t0, _machine(), _sched()
            loop_tid = threading.get_native_id()
            names = {t.native_id: t.name for t in threading.enumerate()}
            run_ms: dict[str, float] = {}
            wait_ms: dict[str, float] = {}
            slices: dict[str, int] = {}
            moves: dict[str, int] = {}
            for key, (r1, w1, s1, m1) in after.items():
                r0, w0, s0, m0 = before.get(key, (0, 0, 0, 0))
                name = _component(*key, loop_tid, names)
                run_ms[name] = run_ms.get(name, 0.0) + (r1 - r0) / 1e6
                wait_ms[name] = wait_ms.get(name, 0.0) + (w1 - w0) / 1e6
                slices[name] = slices.get(name, 0) + s1 - s0
                moves[name] = moves.get(name, 0) + m1 - m0
            _steal_out.write(json.dumps({
                "rids": rids, "n_tokens": sum(len(row.tokens) for row in rows),
                "wall_ms": wall * 1000, "run_ms": run_ms, "wait_ms": wait_ms,
                "slices": slices, "moves": moves,
                "machine_busy_ms": busy1[0] - busy0[0], "steal_ms": busy1[1] - busy0[1]}) + "\n")
            return result

        module.LlamaEngine.decode = probed_decode

    _PROBES.setdefault("scheduler_daemon.scheduler", []).append(_probe_steal)
    _PROBES.setdefault("scheduler_daemon.engine", []).append(_probe_decode)


if os.environ.get("PROBE_GAP_FILE"):
    # Where an admitting tick's time goes, by timestamps only (no /proc reads inside the
    # window): the request's t_started (after its slot's preparation), the tick's run, the
    # decode's start and end, and its first token (the commit's clock, after the decode).
    _gap_out = open(os.environ["PROBE_GAP_FILE"], "a", buffering=1)  # noqa: SIM115
    _gap = threading.local()
    _gap_marks: dict[str, dict[str, float]] = {}  # request id -> its steps' clocks

    def _probe_gap_run(module: Any) -> None:
        run = module.Scheduler.run

        def gap_run(self: Any, plan: Any) -> Any:
            rids = list(plan.admitted)
            _gap.decode = None
            t_run = self._clock()
            try:
                return run(self, plan)
            finally:
                for rid in rids:
                    req = self._requests.get(rid)
                    if req is not None and _gap.decode is not None:
                        _gap_out.write(json.dumps({
                            "rid": rid, "arrival": req.arrival, "started": req.t_started,
                            "run": t_run, "decode": _gap.decode, "first": req.t_first_token,
                            "n_rows": len(plan.rows), **_gap_marks.pop(rid, {})}) + "\n")

        module.Scheduler.run = gap_run
        marks = _gap_marks
        submit, schedule, assign = (module.Scheduler.submit, module.Scheduler.schedule,
                                    module.Scheduler._assign)

        def gap_submit(self: Any, request: Any) -> Any:
            marks.setdefault(request.id, {})["submitted"] = self._clock()
            return submit(self, request)

        def gap_schedule(self: Any) -> Any:
            _gap.schedule = self._clock()
            return schedule(self)

        def gap_assign(self: Any, req: Any, slot: Any) -> Any:
            mark = marks.setdefault(req.id, {})
            mark["schedule"], mark["assign"] = getattr(_gap, "schedule", 0.0), self._clock()
            return assign(self, req, slot)

        module.Scheduler.submit, module.Scheduler.schedule = gap_submit, gap_schedule
        module.Scheduler._assign = gap_assign

    def _probe_gap_decode(module: Any) -> None:
        decode = module.LlamaEngine.decode

        def gap_decode(self: Any, rows: Any, abortable: bool = False) -> Any:
            t0 = time.monotonic()
            try:
                return decode(self, rows, abortable)
            finally:
                if getattr(_gap, "decode", 0) is None:  # the tick's first decode
                    _gap.decode = (t0, time.monotonic())

        module.LlamaEngine.decode = gap_decode

    _PROBES.setdefault("scheduler_daemon.scheduler", []).append(_probe_gap_run)
    _PROBES.setdefault("scheduler_daemon.engine", []).append(_probe_gap_decode)


if os.environ.get("PROBE_NO_ABORT"):
    # An experiment: every decode without the abort callback (a Python ctypes callback that
    # llama.cpp's CPU backend calls after each graph node, taking the GIL each time), as
    # the scheduler installs it for batches of ``abort_min_tokens`` or more.
    def _probe_no_abort(module: Any) -> None:
        decode = module.LlamaEngine.decode

        def plain_decode(self: Any, rows: Any, abortable: bool = False) -> Any:
            return decode(self, rows, False)

        module.LlamaEngine.decode = plain_decode

    _PROBES.setdefault("scheduler_daemon.engine", []).append(_probe_no_abort)


if os.environ.get("PROBE_PIN"):
    # An experiment (bench/prefill_steal.py --this-env PROBE_PIN=1): after the first decode
    # of the thread that decodes, it and its OpenMP workers each on a CPU of their own
    # (``sched_setaffinity`` per thread), so that the two can never share a CPU's queue.
    _pinned: set[int] = set()

    def _probe_pin(module: Any) -> None:
        decode = module.LlamaEngine.decode

        def pinned_decode(self: Any, rows: Any, abortable: bool = False) -> Any:
            result = decode(self, rows, abortable)
            me = threading.get_native_id()
            if me not in _pinned and threading.current_thread().name == "scheduler-loop":
                _pinned.add(me)
                # the OpenMP workers: the threads Python does not know that ran the most
                # (the process has other native threads that hardly run)
                python = {t.native_id for t in threading.enumerate()}
                cpus = sorted(os.sched_getaffinity(0))
                ran = {}
                for tid in (int(t) for t in os.listdir("/proc/self/task")):
                    if tid not in python:
                        with open(f"/proc/self/task/{tid}/schedstat") as f:
                            ran[tid] = int(f.read().split()[0])
                workers = sorted(ran, key=ran.get, reverse=True)[:len(cpus) - 1]
                for cpu, tid in zip(cpus, [me, *workers], strict=False):
                    os.sched_setaffinity(tid, {cpu})
                print(f"probe: pinned {[me, *workers]} to {cpus} (native threads' run ns: "
                      f"{ran})", file=sys.stderr, flush=True)
            return result

        module.LlamaEngine.decode = pinned_decode

    _PROBES.setdefault("scheduler_daemon.engine", []).append(_probe_pin)


class _Finder(importlib.abc.MetaPathFinder):
    """Runs the module's probes right after the module itself."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _PROBES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        inner, probes = spec.loader, _PROBES[name]

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return inner.create_module(spec)

            def exec_module(self, module: Any) -> None:
                inner.exec_module(module)
                for probe in probes:
                    probe(module)

        spec.loader = Loader()
        return spec


if _PROBES:
    sys.meta_path.insert(0, _Finder())
