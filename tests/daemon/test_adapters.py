"""LoRA adapters in a real daemon (Gemma 3 270M, real Redis): a job's adapter is loaded on
demand and changes the output; files that are not what they claim are refused with
``adapter_unusable`` before llama.cpp reads them, and the daemon's pid never changes; an
operator's ``unload_adapter`` unloads it (a job for it after that: 404 ``model_not_found``)."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from config.models import SMOLLM2, default_path
from tests.fixtures.lora_adapter import write_lora
from tests.scheduler.conftest import model_path
from wire import affinity, protocol

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def files():
    # inside the daemons' ADAPTERS_DIR (tests/settings.py: the test run's own folder)
    folder = Path(os.environ["ADAPTERS_DIR"]) / f"daemon-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    good = write_lora(model_path(), folder / "gemma.gguf")
    corrupt = folder / "corrupt.gguf"
    data = bytearray(good.read_bytes())
    data[200:260] = b"\xff" * 60  # the metadata and tensor index scrambled
    corrupt.write_bytes(bytes(data))
    foreign = write_lora(default_path(SMOLLM2), folder / "smollm2.gguf")
    huge = folder / "huge.gguf"
    with huge.open("wb") as f:
        f.write(good.read_bytes()[:4096])
        f.truncate((2 << 30) + 1)  # sparse: past adapter_check.MAX_FILE_BYTES
    outside = Path(tempfile.mkdtemp(prefix="not-adapters-")) / "outside.gguf"
    outside.write_bytes(good.read_bytes())
    return {"good": good, "corrupt": corrupt, "foreign": foreign, "huge": huge,
            "outside": outside}


def spec(path, n: int, scale: float = 1.0, sha: str | None = None) -> dict:
    if sha is None:
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"id": f"ad_{n:016x}", "path": str(path), "sha256": sha, "scale": scale}


def text_of(daemon, job) -> tuple[str, dict]:
    events = daemon.events(job.id)
    kind, data = events[-1][1], events[-1][2]
    text = "".join(d.get("text", "") for _, k, d in events if k == protocol.TOKEN)
    return (text + data.get("text", "") if kind == protocol.DONE else ""), data


@pytest.fixture(scope="module")
def daemon(make_daemon):
    return make_daemon().start()


def until(daemon, check, timeout_s: float = 30) -> dict:
    """The daemon's published adapters summary once ``check`` holds (it beats every second)."""
    deadline = time.monotonic() + timeout_s
    while not check(adapters := daemon.snapshot().get("adapters", {"loaded": []})):
        assert time.monotonic() < deadline, daemon.log_tail()
        time.sleep(0.2)
    return adapters


def ask(daemon, adapter=None):
    return daemon.enqueue(prompt=PROMPT, adapter=adapter, cache_prompt=False,
                          params={"temperature": 0, "max_tokens": 8})


def test_an_adapter_is_loaded_on_demand_and_changes_the_output(daemon, files):
    base, _ = text_of(daemon, ask(daemon))
    tuned, _ = text_of(daemon, ask(daemon, spec(files["good"], 1)))
    assert base and tuned and tuned != base
    again, _ = text_of(daemon, ask(daemon, spec(files["good"], 1)))
    assert again == tuned
    adapters = until(daemon, lambda a: a["loaded"] == ["ad_0000000000000001"])
    assert adapters["loads"] == {"ad_0000000000000001": 1}  # once for both requests
    assert adapters["tokens"]["ad_0000000000000001"] > 0


@pytest.mark.parametrize("name", ["corrupt", "foreign", "huge", "changed", "outside"])
def test_a_file_that_fails_the_check_is_refused_and_the_daemon_lives(daemon, files, name):
    pid = daemon.snapshot()["pid"]
    if name == "changed":  # the registered hash is another file's
        adapter = spec(files["good"], 9, sha="0" * 64)
    elif name == "huge":
        adapter = spec(files["huge"], 3, sha="0" * 64)
    else:
        adapter = spec(files[name], {"corrupt": 2, "foreign": 4, "outside": 6}[name])
    _, data = text_of(daemon, ask(daemon, adapter))
    assert data["code"] == "adapter_unusable"
    assert str(files[name if name != "changed" else "good"]) not in data["message"]
    why = {"corrupt": "refused: ", "foreign": "not for this model's",
           "huge": "larger than", "changed": "its hash differs",
           "outside": "not inside ADAPTERS_DIR"}[name]
    assert f"adapter {adapter['id']} refused: " in daemon.log_tail(400)
    assert why in [line for line in daemon.log_tail(400).splitlines()
                   if f"adapter {adapter['id']} refused" in line][-1]
    assert daemon.snapshot()["pid"] == pid and daemon.proc.poll() is None
    text, _ = text_of(daemon, ask(daemon))  # and it serves on
    assert text


def test_unload_adapter_unloads_it_and_it_is_never_loaded_again(daemon, files):
    adapter = spec(files["good"], 5)
    head = "ab" * 8  # the adapter's head hash, first in its jobs' affinity chains
    job = daemon.enqueue(prompt=PROMPT, adapter=adapter, affinity=[head, "cd" * 8],
                         params={"temperature": 0, "max_tokens": 4})
    text_of(daemon, job)
    until(daemon, lambda a: "ad_0000000000000005" in a["loaded"])
    summary = affinity.summary_key(daemon.daemon_id)
    assert daemon.redis.sismember(summary, head)  # routing prefers this daemon for it
    daemon.redis.xadd(protocol.control_stream(daemon.daemon_id),
                      protocol.encode_command("unload_adapter", adapter=adapter["id"]))
    adapters = until(daemon, lambda a: "ad_0000000000000005" not in a["loaded"])
    assert adapters["unloads"]["ad_0000000000000005"] == 1
    deadline = time.monotonic() + 10
    while daemon.redis.sismember(summary, head):  # dropped by the next beat: no longer held
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert daemon.redis.sismember(summary, "cd" * 8)  # its prefixes' hashes stay
    _, data = text_of(daemon, ask(daemon, adapter))  # (a web process's lookup of 2 s)
    assert data["code"] == "model_not_found" and data["status"] == 404
    assert os.path.exists(files["good"])  # unloading never touches the file


def test_the_quarantine_tells_a_job_under_an_adapter_from_the_same_job_without():
    from scheduler_daemon.service.intake import job_fingerprint

    def job(adapter):
        return protocol.Job(id="x", kind="completion", model="m", tenant_id="1",
                            cache_scope="1", prompt="p", adapter=adapter)

    a = {"id": "ad_0000000000000001", "path": "/a", "sha256": "1" * 64, "scale": 1.0}
    fingerprints = {job_fingerprint(job(x)) for x in (None, a, {**a, "sha256": "2" * 64})}
    assert len(fingerprints) == 3
    assert job_fingerprint(job(a)) == job_fingerprint(job({**a, "path": "/b", "scale": 0.5}))


def test_with_every_loaded_adapter_held_another_is_adapters_busy_then_served(make_daemon,
                                                                             files):
    daemon = make_daemon(MAX_LOADED_ADAPTERS="1").start()
    held = spec(files["good"], 7)
    other = {**spec(files["good"], 8)}  # another adapter (the same file under another id)
    long = daemon.enqueue(prompt=PROMPT, adapter=held, cache_prompt=False,
                          params={"temperature": 0, "max_tokens": 400, "ignore_eos": True})
    daemon.wait_for(long.id, protocol.TOKEN)  # loaded, and held while it runs
    _, data = text_of(daemon, ask(daemon, other))
    assert data["code"] == "adapters_busy" and data["retry_after_s"] == 1
    daemon.cancel(long.id)
    daemon.events(long.id)
    text, _ = text_of(daemon, ask(daemon, other))  # the held one goes: room for it
    assert text
    adapters = until(daemon, lambda a: a["loaded"] == [other["id"]])
    assert adapters["unloads"][held["id"]] == 1


def test_a_daemon_that_starts_after_a_deletion_never_loads_the_adapter(make_daemon, files):
    adapter = spec(files["good"], 0xDD)
    daemon = make_daemon()
    daemon.redis.zadd(protocol.DELETED_ADAPTERS, {adapter["id"]: time.time()})  # the web's
    try:
        daemon.start()
        _, data = text_of(daemon, ask(daemon, adapter))
        assert data["code"] == "model_not_found"
        assert adapter["id"] not in daemon.snapshot()["adapters"].get("loads", {})
    finally:
        daemon.redis.zrem(protocol.DELETED_ADAPTERS, adapter["id"])
