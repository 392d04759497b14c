"""Tenants' adapters, the operator's side: a file is checked when it is registered (inside
ADAPTERS_DIR, a regular file, a LoRA for the base model; inference/adapter_files.py), the
management command, the admin ("loaded on", deletion), daemons told to unload a deleted
adapter, and /metrics' adapter families. Fast: a tiny base model and adapters written here
(MODEL_NAME/MODEL_PATH point at the base); the real Gemma and SmolLM2 once (slow)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from io import StringIO
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command

from inference import adapter_files, adapters
from inference.models import Adapter
from tests.test_adapter_check import adapter as write_adapter
from tests.test_adapter_check import tiny_base
from tests.test_metrics import scrape, value
from wire import adapter_check, protocol


@dataclass
class AdapterEnv:
    """ADAPTERS_DIR (``root``) and a tiny base model served under ``model``."""

    root: Path
    model: str
    outside: Path  # a folder next to ADAPTERS_DIR, not in it

    def write(self, name: str = "a.gguf", **kwargs) -> str:
        """A valid adapter for the base (or what ``kwargs`` make of it), relative path."""
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        write_adapter(path, **kwargs)
        return name


def adapter_env_for(settings, tmp_path: Path, model: str) -> AdapterEnv:
    root, outside = tmp_path / "adapters", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    settings.ADAPTERS_DIR = str(root)
    settings.MODEL_NAME, settings.MODEL_PATH = model, str(tiny_base(tmp_path / "base.gguf"))
    return AdapterEnv(root, model, outside)


@pytest.fixture
def adapter_env(settings, tmp_path) -> AdapterEnv:
    return adapter_env_for(settings, tmp_path, f"tiny-{uuid.uuid4().hex[:6]}")


def registered(tenant, env: AdapterEnv, name: str = "support", file: str | None = None,
               scale: float = 1.0) -> Adapter:
    row = Adapter(tenant=tenant, model=env.model, name=name, file=file or env.write(),
                  default_scale=scale)
    row.full_clean()
    row.save()
    return row


def refusal(tenant, env: AdapterEnv, file: str, **fields) -> str:
    row = Adapter(tenant=tenant, model=env.model, name="x", file=file, **fields)
    with pytest.raises(ValidationError) as caught:
        row.full_clean()
    return " ".join(m for ms in caught.value.message_dict.values() for m in ms)


# -- the file, checked when it is registered --------------------------------------------------


def test_a_good_file_fills_what_the_row_keeps(parties, adapter_env):
    row = registered(parties.a, adapter_env, file=adapter_env.write("team/a.gguf"))
    data = (adapter_env.root / "team" / "a.gguf").read_bytes()
    assert (row.file, row.size_bytes, row.rank, row.alpha) == ("team/a.gguf", len(data), 4, 8.0)
    assert row.sha256 == hashlib.sha256(data).hexdigest()
    assert adapters.ADAPTER_NAME.match(row.name) and row.key.startswith("ad_")
    assert len(row.key) == 19 and int(row.key[3:], 16) >= 0
    assert row.job_adapter() == {"id": row.key, "sha256": row.sha256, "scale": 1.0,
                                 "path": str(adapter_env.root.resolve() / "team" / "a.gguf")}


def test_paths_out_of_the_folder_are_refused(parties, adapter_env):
    write_adapter(adapter_env.outside / "b.gguf")
    for file in ("../elsewhere/b.gguf", str(adapter_env.outside / "b.gguf"), "/etc/passwd",
                 ".", ""):
        message = refusal(parties.a, adapter_env, file)
        assert "not inside ADAPTERS_DIR" in message or "blank" in message, (file, message)


def test_a_link_out_of_the_folder_is_refused_and_one_inside_is_resolved(parties, adapter_env):
    write_adapter(adapter_env.outside / "b.gguf")
    os.symlink(adapter_env.outside / "b.gguf", adapter_env.root / "escape.gguf")
    os.symlink(adapter_env.outside, adapter_env.root / "dir-link")
    assert "not inside ADAPTERS_DIR" in refusal(parties.a, adapter_env, "escape.gguf")
    assert "not inside ADAPTERS_DIR" in refusal(parties.a, adapter_env, "dir-link/b.gguf")
    os.symlink(adapter_env.root / adapter_env.write("real.gguf"), adapter_env.root / "l.gguf")
    assert registered(parties.a, adapter_env, file="l.gguf").file == "real.gguf"


def test_what_is_not_a_regular_file_is_refused(parties, adapter_env):
    (adapter_env.root / "folder").mkdir()
    assert "not a regular file" in refusal(parties.a, adapter_env, "folder")
    os.mkfifo(adapter_env.root / "pipe")
    assert "not a regular file" in refusal(parties.a, adapter_env, "pipe")
    assert "No such file" in refusal(parties.a, adapter_env, "missing.gguf")


def test_corrupt_foreign_and_huge_files_are_refused_with_the_reason(parties, adapter_env):
    good = adapter_env.root / adapter_env.write("good.gguf")
    (adapter_env.root / "cut.gguf").write_bytes(good.read_bytes()[:200])
    (adapter_env.root / "junk.gguf").write_bytes(os.urandom(4096))
    adapter_env.write("gemma.gguf", arch="gemma3")
    adapter_env.write("wide.gguf", tensors={"blk.0.attn_q.weight": ((4, 16), (25, 4))})
    with open(adapter_env.root / "huge.gguf", "wb") as f:  # sparse: no disk used
        f.truncate(adapter_check.MAX_FILE_BYTES + 1)
    cases = {"cut.gguf": "not a LoRA adapter for", "junk.gguf": "not a LoRA adapter for",
             "gemma.gguf": "not for this model's 'llama'", "wide.gguf": "do not fit",
             "huge.gguf": f"larger than {adapter_check.MAX_FILE_BYTES} bytes"}
    for file, why in cases.items():
        message = refusal(parties.a, adapter_env, file)
        assert why in message and file in message, (file, message)
    assert not Adapter.objects.exists()


def test_an_unreadable_base_model_is_a_clear_refusal(parties, adapter_env, settings):
    settings.MODEL_PATH = str(adapter_env.outside / "no-model.gguf")
    assert "cannot read the base model" in refusal(parties.a, adapter_env, adapter_env.write())


@pytest.mark.parametrize("name", ["Upper", "-dash", "a:b", "a b", "x" * 65, "é", "a\n"])
def test_names_are_slugs_without_colons(parties, adapter_env, name):
    row = Adapter(tenant=parties.a, model=adapter_env.model, name=name, file=adapter_env.write())
    with pytest.raises(ValidationError) as caught:
        row.full_clean()
    assert "name" in caught.value.message_dict


@pytest.mark.parametrize("scale", [0.0, -1.0, 4.0001, float("nan"), float("inf")])
def test_default_scales_outside_the_range_are_refused(parties, adapter_env, scale):
    message = refusal(parties.a, adapter_env, adapter_env.write(), default_scale=scale)
    assert "more than 0, at most 4" in message


def test_one_name_per_tenant_and_model(parties, adapter_env):
    registered(parties.a, adapter_env)
    registered(parties.b, adapter_env)  # another tenant may use the same name
    with pytest.raises(ValidationError):
        registered(parties.a, adapter_env)


# -- the command --------------------------------------------------------------------------------


def run(*args: str) -> str:
    out = StringIO()
    call_command("adapters", *args, stdout=out)
    return out.getvalue()


@pytest.fixture
def live_daemons(redis_client):
    """Publish daemon snapshots (as heartbeats do); cleaned up after the test."""
    published: list[str] = []

    def publish(model: str, loaded: list[str] | None = None, **extra) -> str:
        daemon_id = f"adapters-{uuid.uuid4().hex[:6]}"
        snap = {"daemon_id": daemon_id, "model": model, "heartbeat_at": time.time(),
                "started_at": time.time(), "slots": [], "queue": [], "counters": {}, **extra}
        if loaded is not None:
            snap["adapters"] = {"loaded": loaded}
        redis_client.set(protocol.daemon_key(daemon_id), json.dumps(snap), ex=30)
        redis_client.zadd(protocol.DAEMONS_ZSET, {daemon_id: time.time()})
        published.append(daemon_id)
        return daemon_id

    yield publish
    for daemon_id in published:
        redis_client.delete(protocol.daemon_key(daemon_id), protocol.control_stream(daemon_id))
        redis_client.zrem(protocol.DAEMONS_ZSET, daemon_id)


def commands_to(redis_client, daemon_id: str) -> list[dict[str, str]]:
    entries = redis_client.xrange(protocol.control_stream(daemon_id))
    return [protocol.decode_command(fields) for _, fields in entries]


def test_command_add_list_delete(parties, adapter_env, live_daemons, redis_client,
                                 django_capture_on_commit_callbacks):
    file = adapter_env.write()
    out = run("add", "--tenant", "alpha", "--model", adapter_env.model, "--name", "support",
              "--file", file, "--scale", "0.5")
    row = Adapter.objects.get()
    assert row.key in out and (row.tenant, row.default_scale, row.rank) == (parties.a, 0.5, 4)
    run("add", "--tenant", str(parties.b.pk), "--model", adapter_env.model, "--name", "other",
        "--file", str(adapter_env.root / file))  # an id and an absolute path inside
    listed = run("list", "--tenant", "alpha").splitlines()
    assert len(listed) == 1 and listed[0].startswith(f"{row.key}\talpha\t")
    assert len(run("list").splitlines()) == 2
    same_model = live_daemons(adapter_env.model)
    other_model = live_daemons("another-model")
    with django_capture_on_commit_callbacks(execute=True):
        out = run("delete", row.key)
    assert same_model in out and not Adapter.objects.filter(pk=row.pk).exists()
    assert commands_to(redis_client, same_model) == [
        {"action": "unload_adapter", "adapter": row.key}]
    assert commands_to(redis_client, other_model) == []
    # recorded for daemons that start later (protocol.DELETED_ADAPTERS)
    assert redis_client.zscore(protocol.DELETED_ADAPTERS, row.key) is not None
    with django_capture_on_commit_callbacks(execute=True):
        run("delete", "--tenant", "beta", "--model", adapter_env.model, "--name", "other")
    assert not Adapter.objects.exists() and len(commands_to(redis_client, same_model)) == 2


def test_command_errors_exit_non_zero_with_the_reason(parties, adapter_env):
    (adapter_env.root / "junk.gguf").write_bytes(b"GGUF" + os.urandom(100))
    base = ["add", "--tenant", "alpha", "--model", adapter_env.model, "--name", "n"]
    with pytest.raises(CommandError, match="file: junk.gguf is not a LoRA adapter"):
        run(*base, "--file", "junk.gguf")
    with pytest.raises(CommandError, match="not inside ADAPTERS_DIR"):
        run(*base, "--file", "../base.gguf")
    with pytest.raises(CommandError, match="default_scale"):
        run(*base, "--file", adapter_env.write(), "--scale", "9")
    with pytest.raises(CommandError, match="no tenant 'nobody'"):
        run("add", "--tenant", "nobody", "--model", "m", "--name", "n", "--file", "f")
    with pytest.raises(CommandError, match="no such adapter"):
        run("delete", "ad_0000000000000000")
    assert not Adapter.objects.exists()


def test_a_tenants_deletion_unloads_its_adapters(parties, adapter_env, live_daemons,
                                                 redis_client, django_capture_on_commit_callbacks):
    row = registered(parties.a, adapter_env)
    daemon = live_daemons(adapter_env.model)
    with django_capture_on_commit_callbacks(execute=True):
        parties.a.delete()
    assert commands_to(redis_client, daemon) == [{"action": "unload_adapter", "adapter": row.key}]


# -- the admin --------------------------------------------------------------------------------


def test_admin_lists_adapters_per_tenant_with_the_daemons_holding_them(
        admin_client, parties, adapter_env, live_daemons, monkeypatch):
    monkeypatch.setattr(adapters, "_loaded", (0.0, {}))  # no reading of an earlier test's
    mine = registered(parties.a, adapter_env)
    theirs = registered(parties.b, adapter_env, name="theirs")
    holder = live_daemons(adapter_env.model, loaded=[mine.key])
    live_daemons(adapter_env.model)  # an older daemon: no "adapters" in its snapshot
    page = admin_client.get(f"/admin/inference/adapter/?tenant__id__exact={parties.a.pk}")
    text = page.content.decode()
    assert page.status_code == 200 and mine.key in text and theirs.key not in text
    assert holder in text
    detail = admin_client.get(f"/admin/inference/adapter/{mine.pk}/change/").content.decode()
    assert holder in detail and mine.sha256 in detail
    tenants = admin_client.get("/admin/accounts/tenant/").content.decode()
    assert f"/admin/inference/adapter/?tenant__id__exact={parties.a.pk}" in tenants


def test_admin_add_checks_the_file_and_delete_unloads(admin_client, parties, adapter_env,
                                                      live_daemons, redis_client,
                                                      django_capture_on_commit_callbacks):
    (adapter_env.root / "junk.gguf").write_bytes(os.urandom(512))
    form = {"tenant": parties.a.pk, "model": adapter_env.model, "name": "support",
            "default_scale": "1.0"}
    page = admin_client.post("/admin/inference/adapter/add/", {**form, "file": "junk.gguf"})
    assert page.status_code == 200 and "is not a LoRA adapter for" in page.content.decode()
    assert not Adapter.objects.exists()
    page = admin_client.post("/admin/inference/adapter/add/", {**form, "file": adapter_env.write()})
    assert page.status_code == 302
    row = Adapter.objects.get()
    daemon = live_daemons(adapter_env.model)
    with django_capture_on_commit_callbacks(execute=True):
        page = admin_client.post(f"/admin/inference/adapter/{row.pk}/delete/", {"post": "yes"})
    assert page.status_code == 302 and not Adapter.objects.exists()
    assert commands_to(redis_client, daemon) == [{"action": "unload_adapter", "adapter": row.key}]


# -- /metrics -----------------------------------------------------------------------------------


def test_metrics_count_adapters_by_id_only(live_daemons):
    a, b = "ad_" + "0" * 15 + "a", "ad_" + "f" * 16
    daemon = live_daemons("m-adapters", adapters={
        "loaded": [a, "my-secret-name", "ad_XYZ"],
        "loads": {a: 3, b: 1, "tenant-chosen": 5, "ad_" + "0" * 17: 1},
        "unloads": {b: 1}, "tokens": {a: 120, b: 7, "x": 9}})
    old = live_daemons("m-adapters")  # no "adapters": none
    got = scrape()
    d = {"daemon": daemon, "model": "m-adapters"}
    assert value(got, "llm_adapter_loads_total", adapter=a, **d) == 3
    assert value(got, "llm_adapter_loads_total", adapter=b, **d) == 1
    assert value(got, "llm_adapter_unloads_total", adapter=b, **d) == 1
    assert value(got, "llm_adapter_tokens_total", adapter=a, **d) == 120
    assert value(got, "llm_adapter_loaded", adapter=a, **d) == 1
    assert value(got, "llm_adapter_loaded", adapter=b, **d) == 0
    for family in ("llm_adapter_loads", "llm_adapter_unloads", "llm_adapter_tokens",
                   "llm_adapter_loaded"):
        labels = {s.labels["adapter"] for s in got[family] if s.labels["daemon"] == daemon}
        assert labels <= {a, b} and labels, family
        assert not [s for s in got[family] if s.labels["daemon"] == old]


def test_metrics_cap_the_adapters_of_one_daemon(live_daemons, monkeypatch):
    from inference import metrics

    monkeypatch.setattr(metrics, "MAX_ADAPTERS_PER_DAEMON", 3)
    ids = [f"ad_{i:016x}" for i in range(10)]
    daemon = live_daemons("m-adapters", adapters={"loaded": ids, "loads": dict.fromkeys(ids, 1)})
    got = scrape()
    assert len([s for s in got["llm_adapter_loaded"] if s.labels["daemon"] == daemon]) == 3


# -- the real models' files (slow) ------------------------------------------------------------


@pytest.fixture(scope="module")
def real_loras(tmp_path_factory):
    """A LoRA written for Gemma's base and one for SmolLM2's (tests/fixtures/lora_adapter)."""
    from config.models import CATALOG, GEMMA, SMOLLM2, default_path
    from tests.fixtures.lora_adapter import write_lora

    folder = tmp_path_factory.mktemp("real-loras")
    return {"gemma": write_lora(default_path(GEMMA), folder / "gemma.gguf"),
            "smollm2": write_lora(CATALOG[SMOLLM2].path(), folder / "smollm2.gguf", rank=4)}


@pytest.mark.slow
def test_real_adapters_pass_for_their_base_only(parties, settings, tmp_path, real_loras):
    from config.models import GEMMA

    settings.ADAPTERS_DIR = str(tmp_path)
    for path in real_loras.values():
        shutil.copy(path, tmp_path / path.name)
    row = Adapter(tenant=parties.a, model=GEMMA, name="g", file="gemma.gguf")
    row.full_clean()
    assert (row.rank, row.alpha, row.size_bytes) == (8, 16.0, real_loras["gemma"].stat().st_size)
    foreign = Adapter(tenant=parties.a, model=GEMMA, name="s", file="smollm2.gguf")
    with pytest.raises(ValidationError, match="an adapter for 'llama', not for this model's "
                                              "'gemma3'"):
        foreign.full_clean()
    assert adapter_files.base_shapes(GEMMA)[0] == "gemma3"
