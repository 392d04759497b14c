"""docker-compose.yml stays in step with the code (Docker itself cannot run here)."""

import ast
from pathlib import Path

import pytest
import yaml

BASE_DIR = Path(__file__).resolve().parent.parent
ENV_HELPERS = {"env_str", "env_bool", "env_int", "env_float", "env_list"}
REQUIRED = {"SECRET_KEY", "DATABASE_URL", "REDIS_URL", "MODEL_PATH"}


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


def test_web_runs_daphne_on_the_asgi_app(services):
    cmd = command(services["web"])
    assert "daphne" in cmd
    assert "config.asgi:application" in cmd


def test_scheduler_runs_the_daemon_command(services):
    assert "manage.py run_scheduler" in command(services["scheduler"])


def test_app_services_use_only_variables_settings_reads(services):
    known = settings_env_names()
    assert REQUIRED <= known
    for name, service in services.items():
        if "build" not in service:  # third-party images (redis, postgres) have their own
            continue
        unknown = environment(service).keys() - known
        assert not unknown, f"{name} sets variables settings.py never reads: {unknown}"


def test_web_and_scheduler_get_the_required_variables(services):
    for name in ("web", "scheduler"):
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
