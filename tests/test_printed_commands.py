"""Every ``manage.py`` command the README, docs and the commands' own hints print works as
printed from a plain shell, after ``make run``'s set-up.

A copy of the checkout (the files git tracks or would, the real .venv linked in) is set up the way
``make run`` does it (DEBUG=true: migrate, seed_demo, which makes its .secret_key); then each
command runs with an environment a new shell has (PATH, HOME, LANG: no DEBUG, no
SECRET_KEY, no settings module), from the copy's root, exactly as the docs spell it. Only
REDIS_URL is set, to the tests' database: no command may touch a running service's data.
"""
from __future__ import annotations

import os
import re
import runpy
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from django.conf import settings

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
# `manage.py <command> ...` as the docs and hints spell it, up to a backtick, a comment or
# the line's end. Lines that run it in compose's containers (`docker compose run ...`) are
# compose's, checked by reading (tests/test_compose.py checks the file).
COMMAND = re.compile(r"(?:(?:\.venv/bin/)?python )?manage\.py ([a-z_]+)((?: [^`#\n]*)?)")
DOCUMENTS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
             "scripts/dev.py"]


def printed_commands() -> dict[str, list[str]]:
    """{command name: the lines that print it} from the README, docs and scripts/dev.py."""
    found: dict[str, list[str]] = {}
    for name in DOCUMENTS:
        for line in (ROOT / name).read_text().splitlines():
            if "docker compose" in line:
                continue
            for match in COMMAND.finditer(line):
                found.setdefault(match.group(1), []).append(f"{name}: {line.strip()}")
    return found


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("checkout")
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=ROOT, check=True,
                             capture_output=True).stdout.decode().split("\0")
    for relative in filter(None, tracked):
        source = ROOT / relative
        if source.is_file():
            (copy / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / relative)
    (copy / ".venv").symlink_to(ROOT / ".venv")
    make_run = {**plain_env(), "DEBUG": "true"}  # scripts/dev.py's main() sets it
    for command in (["migrate"], ["seed_demo"]):
        run(copy, [".venv/bin/python", "manage.py", *command], make_run)
    assert (copy / ".secret_key").is_file()
    return copy


def plain_env() -> dict[str, str]:
    env = {name: os.environ[name] for name in ("PATH", "HOME", "LANG") if name in os.environ}
    env["REDIS_URL"] = settings.REDIS_URL
    return env


def run(where: Path, argv: list[str], env: dict[str, str] | None = None,
        stdin: str = "") -> str:
    done = subprocess.run(argv, cwd=where, env=env or plain_env(), input=stdin,
                          capture_output=True, text=True, timeout=120,
                          start_new_session=True)  # no terminal: getpass reads stdin
    assert done.returncode == 0, f"{shlex.join(argv)}: {done.stdout}{done.stderr}"
    return done.stdout


def as_printed(where: Path, text: str, stdin: str = "") -> str:
    """Runs the command line `text` as a shell would split it."""
    return run(where, shlex.split(text), stdin=stdin)


def hints(output: str) -> list[str]:
    return [m.group(0) for m in COMMAND.finditer(output)]


# How each documented command is run: the documented line itself where it can run here,
# else its --help (which loads the settings, the part a plain shell broke).
EXERCISED = {
    "migrate": ".venv/bin/python manage.py migrate",
    "seed_demo": ".venv/bin/python manage.py seed_demo",
    "create_tenant": '.venv/bin/python manage.py create_tenant acme --name "Acme"',
    "create_api_key": ".venv/bin/python manage.py create_api_key acme --name laptop",
    "changepassword": ".venv/bin/python manage.py changepassword admin",
    "adapters": ".venv/bin/python manage.py adapters list --tenant acme",
    "spectacular": ".venv/bin/python manage.py spectacular --format openapi-json",
    "run_scheduler": ".venv/bin/python manage.py run_scheduler --supervise --help",
    "invite": ".venv/bin/python manage.py invite demo someone@example.com --role owner",
}


def test_every_printed_command_is_exercised_here():
    found = printed_commands()
    assert {"create_api_key", "run_scheduler", "migrate"} <= found.keys()  # the scan works
    missing = {name: lines for name, lines in found.items() if name not in EXERCISED}
    assert not missing, f"commands printed but not run by this test: {missing}"


def test_the_documented_commands_run_from_a_plain_shell(checkout):
    for name in ("migrate", "seed_demo", "create_tenant", "adapters", "run_scheduler"):
        as_printed(checkout, EXERCISED[name])
    lines = as_printed(checkout, EXERCISED["create_api_key"]).splitlines()
    assert lines[-1].startswith("sk-")
    assert '"openapi"' in as_printed(checkout, EXERCISED["spectacular"])
    link = as_printed(checkout, EXERCISED["invite"]).splitlines()[-1]
    assert "/console/password/reset/" in link
    password = "a-new-Password-4-admin"
    as_printed(checkout, EXERCISED["changepassword"], stdin=f"{password}\n{password}\n")


def test_the_hints_the_commands_print_run_as_printed(checkout):
    printed = hints(as_printed(checkout, ".venv/bin/python manage.py seed_demo"))
    assert printed == [".venv/bin/python manage.py create_api_key demo",
                       ".venv/bin/python manage.py changepassword admin"]
    key = as_printed(checkout, printed[0]).splitlines()[-1]
    assert key.startswith("sk-")
    as_printed(checkout, printed[1], stdin="another-Password-7\nanother-Password-7\n")
    refused = subprocess.run(shlex.split(".venv/bin/python manage.py create_api_key nobody"),
                             cwd=checkout, env=plain_env(), capture_output=True, text=True,
                             timeout=120)
    [create] = hints(refused.stderr)
    assert create == ".venv/bin/python manage.py create_tenant nobody"
    as_printed(checkout, create)
    assert as_printed(checkout, ".venv/bin/python manage.py create_api_key nobody"
                      ).splitlines()[-1].startswith("sk-")


def test_make_runs_hint_without_a_key_is_the_command_that_works(checkout):
    dev = runpy.run_path(str(ROOT / "scripts" / "dev.py"))
    [printed] = hints(dev["curl_example"]("http://x", None))
    assert as_printed(checkout, printed).splitlines()[-1].startswith("sk-")


def test_a_deployment_without_a_secret_key_is_still_refused(tmp_path, checkout):
    """Only a checkout with make run's .secret_key gets its defaults: elsewhere (a
    deployment: its image holds no .secret_key) a missing SECRET_KEY stops every command."""
    bare = tmp_path / "bare"
    shutil.copytree(checkout, bare, symlinks=True,
                    ignore=shutil.ignore_patterns(".secret_key", "db.sqlite3*"))
    done = subprocess.run([".venv/bin/python", "manage.py", "check"], cwd=bare,
                          env=plain_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "SECRET_KEY must be set" in done.stderr
