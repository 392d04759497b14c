"""Settings: secure defaults (DEBUG off), a laptop mode that works (DEBUG=true, as the dev
launcher sets it), and a refusal to run insecurely."""

import fnmatch
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command

from config.env import env_bool, env_float, env_int, env_list, env_str
from config.models import CATALOG
from tests.conftest import TEST_REDIS_URL

BASE_DIR = Path(__file__).resolve().parent.parent


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    """manage.py in a clean environment: HOME, PATH and what the test passes."""
    clean = {"HOME": os.environ["HOME"], "PATH": os.environ["PATH"], **env}
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=BASE_DIR,
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_passes():
    call_command("check")


def test_dev_mode_gives_a_working_sqlite_setup(tmp_path):
    database_url = f"sqlite:///{tmp_path / 'db.sqlite3'}"
    for args in (["check"], ["migrate", "--noinput"]):
        result = manage(*args, DEBUG="true", DATABASE_URL=database_url,
                        REDIS_URL=TEST_REDIS_URL)
        assert result.returncode == 0, result.stderr
    assert (tmp_path / "db.sqlite3").stat().st_size > 0


DEFAULTS_READ = [
    "DEBUG", "ALLOWED_HOSTS", "TRUST_ROOT_PATH_HEADER", "ROOT_PATH", "REDIS_URL", "MODELS",
    "MODEL_NAME", "MODEL_PATH", "N_PARALLEL", "N_CTX", "N_BATCH", "CHUNK_SIZE",
    "KV_BLOCK_TOKENS", "MAX_QUEUE", "MAX_PROMPT_BYTES", "DATA_UPLOAD_MAX_MEMORY_SIZE",
    "PROMPT_CACHE_TENANT_SHARE", "N_THREADS",
]


def test_the_defaults_are_secure_and_fit_together():
    """With nothing set but the secret key: secure (no debug mode, no host allowed until
    production names its own, no proxy header trusted); working on one machine (an SQLite
    file in the checkout that git ignores, a local Redis, the first default model, a chat
    model, served from its installed file); and the daemon's sizes consistent."""
    script = (
        "import json; from django.conf import settings as s; d = s.DATABASES['default']; "
        f"v = {{n: getattr(s, n) for n in {DEFAULTS_READ!r}}}; "
        "v.update(ENGINE=d['ENGINE'], NAME=str(d['NAME'])); print(json.dumps(v))"
    )
    result = manage("shell", "-c", script, SECRET_KEY="x" * 50)
    assert result.returncode == 0, result.stderr
    v = json.loads(result.stdout.strip().splitlines()[-1])
    # secure unless set (scripts/dev.py sets DEBUG for make run)
    assert v["DEBUG"] is False and v["ALLOWED_HOSTS"] == []
    assert v["TRUST_ROOT_PATH_HEADER"] is False and v["ROOT_PATH"] == ""
    # one machine, nothing to set up first
    assert v["ENGINE"] == "django.db.backends.sqlite3"
    database = Path(v["NAME"])
    assert database.parent == BASE_DIR
    ignored = (BASE_DIR / ".gitignore").read_text().splitlines()
    assert any(fnmatch.fnmatch(database.name, pattern) for pattern in ignored)
    assert urlsplit(v["REDIS_URL"]).hostname in ("127.0.0.1", "localhost")
    # a daemon without MODEL_NAME serves the first model the web serves: a chat model (#16)
    assert v["MODELS"] and set(v["MODELS"]) <= CATALOG.keys()
    assert v["MODEL_NAME"] == v["MODELS"][0] and CATALOG[v["MODEL_NAME"]].chat
    assert v["MODEL_PATH"] == str(CATALOG[v["MODEL_NAME"]].path())
    # sizes: a prefill chunk fits a batch, which fits the context; a prompt that fits the
    # context is never refused for its bytes (Gemma's longest token is 31 bytes), and one at
    # the byte cap fits a request body (refused for its prompt, not as a body too large)
    assert 1 <= v["CHUNK_SIZE"] <= v["N_BATCH"] <= v["N_CTX"]
    assert 1 <= v["KV_BLOCK_TOKENS"] <= v["N_CTX"]
    assert v["N_PARALLEL"] >= 1 and v["MAX_QUEUE"] >= 1
    assert 31 * v["N_CTX"] <= v["MAX_PROMPT_BYTES"] < v["DATA_UPLOAD_MAX_MEMORY_SIZE"]
    assert 0 < v["PROMPT_CACHE_TENANT_SHARE"] <= 1
    assert v["N_THREADS"] == os.cpu_count()  # every core unless told


def test_a_daemon_finds_its_models_file_by_name():
    """MODEL_PATH follows MODEL_NAME through the catalog; a name outside it gets Gemma's file
    (tests run daemons under names of their own); MODEL_PATH set wins."""
    script = "from django.conf import settings as s; print(s.MODEL_PATH)"
    cases = (({"MODEL_NAME": "gemma-3-270m"}, "gemma-3-270m-q4_k_m.gguf"),
             ({"MODEL_NAME": "gemma-test-x"}, "gemma-3-270m-q4_k_m.gguf"),
             ({"MODEL_NAME": "smollm2-135m-instruct"}, "SmolLM2-135M-Instruct.Q4_1.gguf"),
             ({"MODELS": "gemma-3-270m"}, "gemma-3-270m-q4_k_m.gguf"),
             ({"MODEL_PATH": "/x/y.gguf"}, "/x/y.gguf"))
    for env, expected in cases:
        result = manage("shell", "-c", script, SECRET_KEY="x" * 50, **env)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip().splitlines()[-1].endswith(expected), (env, result.stdout)


def test_a_daemon_without_its_model_file_says_so_and_is_not_restarted():
    result = manage("run_scheduler", "--supervise", SECRET_KEY="x" * 50, DEBUG="true",
                    REDIS_URL=TEST_REDIS_URL, MODEL_NAME="nope", MODEL_PATH="/no/such.gguf")
    assert result.returncode != 0
    assert "MODEL_PATH=/no/such.gguf is not a file" in result.stderr


def test_secret_key_is_required_without_debug():
    """DEBUG unset: in a checkout make run set up, manage.py takes make run's defaults; in
    one without its .secret_key (a deployment) the key is required:
    tests/test_printed_commands.py runs both."""
    result = manage("check", REDIS_URL=TEST_REDIS_URL, DEBUG="false")
    assert result.returncode != 0
    assert "SECRET_KEY must be set when DEBUG is off" in result.stderr


def test_prompt_byte_cap_follows_the_context_unless_set():
    script = "from django.conf import settings as s; print(s.MAX_PROMPT_BYTES)"
    for env, expected in (({"N_CTX": "2048"}, 65536), ({"MAX_PROMPT_BYTES": "1000"}, 1000)):
        result = manage("shell", "-c", script, DEBUG="true", **env)
        assert result.returncode == 0, result.stderr
        assert int(result.stdout.strip().splitlines()[-1]) == expected


def test_dev_launcher_turns_debug_on_unless_set():
    """scripts/dev.py (make run / make test) runs Django in debug mode on a laptop."""
    script = """
import os, runpy, sys
sys.argv = ["dev.py", "no-such-command"]  # argparse refuses it after main's setup
main = runpy.run_path("scripts/dev.py")["main"]
try:
    main()
except SystemExit:
    pass
print("DEBUG=" + os.environ.get("DEBUG", "<unset>"))
"""
    for preset, expected in (({}, "true"), ({"DEBUG": "false"}, "false")):
        result = subprocess.run([sys.executable, "-c", script], cwd=BASE_DIR, timeout=60,
                                env={"HOME": os.environ["HOME"], "PATH": os.environ["PATH"],
                                     **preset}, capture_output=True, text=True)
        assert f"DEBUG={expected}" in result.stdout.splitlines(), result.stdout + result.stderr


def test_production_settings_pass_check(tmp_path):
    result = manage(
        "check",
        DEBUG="false",
        SECRET_KEY="x" * 50,
        ALLOWED_HOSTS="api.example.com",
        DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
        REDIS_URL=TEST_REDIS_URL,
    )
    assert result.returncode == 0, result.stderr


def test_env_helpers(monkeypatch):
    monkeypatch.setenv("X_BOOL", "Yes")
    monkeypatch.setenv("X_INT", "12")
    monkeypatch.setenv("X_FLOAT", "0.5")
    monkeypatch.setenv("X_LIST", "a, b,,c")
    monkeypatch.delenv("X_UNSET", raising=False)
    assert env_bool("X_BOOL", False) is True
    assert env_int("X_INT", 1) == 12
    assert env_float("X_FLOAT", 1.0) == 0.5
    assert env_list("X_LIST", []) == ["a", "b", "c"]
    assert env_str("X_UNSET", "dflt") == "dflt"
    assert env_int("X_UNSET", 7) == 7
    monkeypatch.setenv("X_BOOL", "maybe")
    with pytest.raises(ImproperlyConfigured, match="X_BOOL"):
        env_bool("X_BOOL", False)
    monkeypatch.setenv("X_INT", "twelve")
    with pytest.raises(ImproperlyConfigured, match="X_INT"):
        env_int("X_INT", 1)


def test_tests_use_the_test_redis(redis_client):
    from django.conf import settings

    assert settings.REDIS_URL == os.environ["REDIS_URL"] == TEST_REDIS_URL
    assert redis_client.ping()
    assert redis_client.connection_pool.connection_kwargs.get("db", 0) != 0


def test_database_connections_are_kept_by_long_lived_threads_or_pooled():
    """SQLite: CONN_MAX_AGE keeps the web's database thread's connection (and the daemon
    writer's); PostgreSQL: Django's pool (CONN_MAX_AGE 0), or persistent when it is off.
    Health checks either way."""
    script = ("import json; from django.conf import settings as s; d = s.DATABASES['default']; "
              "print(json.dumps([d['CONN_MAX_AGE'], d['CONN_HEALTH_CHECKS'], "
              "d.get('OPTIONS', {}).get('pool')]))")
    postgres = "postgres://u@db.invalid:5432/x"
    for env, expected in (({}, [600, True, None]),
                          ({"DATABASE_URL": postgres}, [0, True, True]),
                          ({"DATABASE_URL": postgres, "DATABASE_POOL": "false"},
                           [600, True, None])):
        result = manage("shell", "-c", script, DEBUG="true", **env)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout.strip().splitlines()[-1]) == expected, env


PRODUCTION = {"DEBUG": "false", "SECRET_KEY": "k3y-" + "x9Y" * 16, "ALLOWED_HOSTS": "example.com",
              "REDIS_URL": TEST_REDIS_URL}


def test_check_deploy_is_clean_in_production_settings():
    result = manage("check", "--deploy", "--fail-level", "WARNING", **PRODUCTION)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


def test_djangos_deploy_checks_pass_with_the_sites_middleware():
    """config/middleware.py runs SITE_MIDDLEWARE, so Django's own security checks (which
    look in MIDDLEWARE, and are silenced there) run here with that list in its place."""
    script = (
        "from django.conf import settings; from django.core import checks; "
        "from django.test.utils import override_settings\n"
        "with override_settings(MIDDLEWARE=settings.SITE_MIDDLEWARE, SILENCED_SYSTEM_CHECKS="
        "['security.W021']):\n"
        "    issues = checks.run_checks(include_deployment_checks=True, "
        "tags=[checks.Tags.security])\n"
        "print('ISSUES', [i.id for i in issues if not i.is_silenced()])"
    )
    result = manage("shell", "-c", script, **PRODUCTION)
    assert result.returncode == 0, result.stderr
    assert "ISSUES []" in result.stdout.splitlines(), result.stdout


def test_https_settings_are_on_in_production_and_each_can_be_turned_off():
    script = ("import json; from django.conf import settings as s; print(json.dumps([s."
              "SECURE_SSL_REDIRECT, s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, "
              "s.SECURE_HSTS_SECONDS, s.SECURE_HSTS_INCLUDE_SUBDOMAINS, "
              "s.SECURE_PROXY_SSL_HEADER, s.SESSION_COOKIE_HTTPONLY, s.SESSION_COOKIE_SAMESITE, "
              "s.SECURE_CONTENT_TYPE_NOSNIFF, s.X_FRAME_OPTIONS]))")
    fixed = [True, "Lax", True, "DENY"]
    forwarded = ["HTTP_X_FORWARDED_PROTO", "https"]
    cases = (
        (PRODUCTION, [True, True, True, 31_536_000, True, forwarded, *fixed]),
        ({**PRODUCTION, "HTTPS_ONLY": "false"}, [False, False, False, 0, True, forwarded, *fixed]),
        ({**PRODUCTION, "SECURE_SSL_REDIRECT": "false", "SECURE_HSTS_SECONDS": "60",
          "SECURE_HSTS_INCLUDE_SUBDOMAINS": "false", "TRUST_FORWARDED_PROTO": "false"},
         [False, True, True, 60, False, None, *fixed]),
        ({"DEBUG": "true"}, [False, False, False, 0, True, forwarded, *fixed]),
    )
    for env, expected in cases:
        result = manage("shell", "-c", script, **env)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout.strip().splitlines()[-1]) == expected, env
