"""The daemon's probe for bench/ttft_phases.py (on PYTHONPATH of the daemon it starts, never
of the service): when ``$PROBE_DAEMON_FILE`` is set, the intake's and the scheduler's steps
are wrapped as their modules are imported, and each step's wall-clock time is written as a
JSON line (by jobs-stream entry or request id). Only this project's own classes are
wrapped."""
from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time
from typing import Any

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

    class _Finder(importlib.abc.MetaPathFinder):
        probes = {"scheduler_daemon.intake": _probe_intake,
                  "scheduler_daemon.scheduler": _probe_scheduler}

        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name not in self.probes:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            inner, probe = spec.loader, self.probes[name]

            class Loader(importlib.abc.Loader):
                def create_module(self, spec: Any) -> Any:
                    return inner.create_module(spec)

                def exec_module(self, module: Any) -> None:
                    inner.exec_module(module)
                    probe(module)

            spec.loader = Loader()
            return spec

    sys.meta_path.insert(0, _Finder())
