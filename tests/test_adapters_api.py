"""Requests that pick a tenant's adapter (``"model": "<base>:<adapter>"`` or ``"lora"``),
/v1/models per key, and an adapter job's affinity chain, in-process with a stand-in daemon
(its jobs read back as a daemon takes them). Another tenant's adapter answers exactly as
an unknown model does."""

from __future__ import annotations

import json
import uuid

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator

from config.asgi import application
from inference.models import Adapter, InferenceRequest
from inference.openai_request import CHAT, COMPLETION, _tenant_salt, parse_request
from tests.conftest import bearer
from tests.live_service import echo
from tests.test_adapters import adapter_env_for, registered
from wire import affinity, protocol

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
HELLO = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def env(settings, tmp_path, standin):
    """ADAPTERS_DIR and a tiny base served as the stand-in's model; alpha's adapter
    ``support`` (scale 0.5) and beta's ``secret``."""
    return adapter_env_for(settings, tmp_path, standin.model)


@pytest.fixture
def rows(parties, env):
    return {"support": registered(parties.a, env, "support", scale=0.5),
            "secret": registered(parties.b, env, "secret", file=env.write("b.gguf"))}


def post(api, body, key, path=CHAT_PATH):
    return api.generic("POST", path, json.dumps(body), content_type="application/json",
                       **bearer(key))


def served(api, standin, body, key, path=CHAT_PATH) -> tuple[dict, protocol.Job]:
    jobs: list[protocol.Job] = []

    def answer(daemon, job):
        jobs.append(job)
        echo(daemon, job)

    thread = standin.serve(answer)
    reply = post(api, body, key, path)
    thread.join(10)
    assert reply.status_code == 200, reply.content
    return reply.json(), jobs[0]


def chat(model: str, **extra) -> dict:
    return {"model": model, "messages": HELLO, **extra}


# -- resolution ---------------------------------------------------------------------------------


def test_base_colon_adapter_fills_the_job_and_echoes_the_model(api, parties, standin, rows):
    row = rows["support"]
    body, job = served(api, standin, chat(f"{standin.model}:support"), parties.member)
    assert job.model == standin.model  # the base: its daemons serve the adapter
    assert job.adapter == {"id": row.key, "path": str(row.job_adapter()["path"]),
                           "sha256": row.sha256, "scale": 0.5}
    assert job.adapter["path"].startswith("/") and job.adapter["path"].endswith("/a.gguf")
    assert body["model"] == f"{standin.model}:support"
    assert InferenceRequest.objects.get(id=job.id).model == f"{standin.model}:support"


def test_lora_field_with_and_without_a_scale(api, parties, standin, rows):
    _, job = served(api, standin, chat(standin.model, lora={"name": "support"}), parties.owner)
    assert (job.adapter["id"], job.adapter["scale"]) == (rows["support"].key, 0.5)
    body, job = served(api, standin, {"model": standin.model, "prompt": "Hi",
                                      "lora": {"name": "support", "scale": 2}},
                       parties.owner, COMPLETIONS_PATH)
    assert job.adapter["scale"] == 2.0 and isinstance(job.adapter["scale"], float)
    assert body["model"] == f"{standin.model}:support"
    _, job = served(api, standin, chat(f"{standin.model}:support",
                                       lora={"name": "support", "scale": 4}), parties.owner)
    assert job.adapter["scale"] == 4.0


def test_the_base_model_has_no_adapter(api, parties, standin, rows):
    body, job = served(api, standin, chat(standin.model), parties.owner)
    assert job.adapter is None and body["model"] == standin.model


async def sse_text(reply) -> str:
    return b"".join([chunk async for chunk in reply.streaming_content]).decode()


def test_streamed_replies_name_the_adapter(api, parties, standin, rows):
    standin.serve(echo)
    reply = post(api, chat(f"{standin.model}:support", stream=True), parties.owner)
    assert reply.status_code == 200
    text = async_to_sync(sse_text)(reply)
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {f"{standin.model}:support"}


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_websocket_accepted_names_the_adapter(parties, standin, settings, tmp_path):
    from asgiref.sync import sync_to_async

    env = adapter_env_for(settings, tmp_path, standin.model)
    row = await sync_to_async(registered)(parties.a, env)
    jobs: list[protocol.Job] = []
    standin.serve(lambda daemon, job: (jobs.append(job), echo(daemon, job)))
    ws = WebsocketCommunicator(application, "/ws/v1/stream",
                               headers=[(b"authorization", f"Bearer {parties.owner}".encode())])
    assert (await ws.connect())[0]
    await ws.send_json_to({"type": "chat.completions", "id": "a", "messages": HELLO,
                           "model": standin.model, "lora": {"name": "support"}})
    accepted = await ws.receive_json_from(timeout=10)
    assert (accepted["type"], accepted["model"]) == ("accepted", f"{standin.model}:support")
    while (await ws.receive_json_from(timeout=10))["type"] != "done":
        pass
    assert jobs[0].adapter["id"] == row.key
    await ws.disconnect()


def not_found(reply, sent: str) -> bytes:
    """The 404 body, with the name the client sent taken out."""
    assert reply.status_code == 404, reply.content
    assert reply.json()["error"]["code"] == "model_not_found"
    assert reply.json()["error"]["message"] == f"The model '{sent}' does not exist."
    return reply.content.replace(sent.encode(), b"<sent>")


def test_another_tenants_adapter_is_exactly_an_unknown_model(api, parties, standin, rows):
    """No oracle: beta's ``secret`` and a name nobody has answer alike, byte for byte."""
    base = standin.model
    theirs = not_found(post(api, chat(f"{base}:secret"), parties.owner), f"{base}:secret")
    nobodys = not_found(post(api, chat(f"{base}:nobody"), parties.owner), f"{base}:nobody")
    unknown = not_found(post(api, chat("gpt-9:secret"), parties.owner), "gpt-9:secret")
    assert theirs == nobodys == unknown
    lora_theirs = not_found(post(api, chat(base, lora={"name": "secret"}), parties.owner),
                            f"{base}:secret")
    lora_nobodys = not_found(post(api, chat(base, lora={"name": "nobody"}), parties.owner),
                             f"{base}:nobody")
    assert lora_theirs == lora_nobodys
    assert json.loads(lora_theirs)["error"]["param"] == "lora"
    for odd in (f"{base}:", f"{base}:UPPER", f"{base}:{'x' * 65}", ":support"):
        not_found(post(api, chat(odd), parties.owner), odd)
    assert not InferenceRequest.objects.exists()
    _, job = served(api, standin, chat(f"{base}:secret"), parties.outsider)  # beta's own
    assert job.adapter["id"] == rows["secret"].key


@pytest.mark.parametrize("lora, why", [
    ("support", "must be an object"),
    (["support"], "must be an object"),
    ({"name": "support", "scale": 1, "rank": 4}, "must be an object"),
    ({"scale": 1}, "lora.name"),
    ({"name": 7}, "lora.name"),
    ({"name": ""}, "lora.name"),
    ({"name": "support", "scale": 0}, "lora.scale"),
    ({"name": "support", "scale": -1}, "lora.scale"),
    ({"name": "support", "scale": 4.5}, "lora.scale"),
    ({"name": "support", "scale": True}, "lora.scale"),
    ({"name": "support", "scale": "1"}, "lora.scale"),
    ({"name": "support", "scale": 10**400}, "lora.scale"),
])
def test_bad_lora_fields_are_400_naming_lora(api, parties, standin, rows, lora, why):
    reply = post(api, chat(standin.model, lora=lora), parties.owner)
    assert reply.status_code == 400, reply.content
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == ("lora", "invalid_request_error")
    assert why in error["message"]


def test_an_infinite_scale_is_400(api, parties, standin, rows):
    raw = (f'{{"model": "{standin.model}", "messages": [{{"role": "user", "content": "x"}}], '
           '"lora": {"name": "support", "scale": 1e999}}')
    reply = api.generic("POST", CHAT_PATH, raw, content_type="application/json",
                        **bearer(parties.owner))
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "lora"


def test_lora_naming_another_adapter_than_the_model_is_400(api, parties, standin, rows):
    reply = post(api, chat(f"{standin.model}:support", lora={"name": "other"}), parties.owner)
    assert reply.status_code == 400, reply.content
    assert reply.json()["error"]["param"] == "lora"


def test_a_deleted_adapter_is_not_found(api, parties, standin, rows):
    rows["support"].delete()
    not_found(post(api, chat(f"{standin.model}:support"), parties.owner),
              f"{standin.model}:support")


# -- /v1/models -------------------------------------------------------------------------------


def test_models_list_the_keys_tenants_adapters_of_served_models(api, parties, standin, rows,
                                                                env):
    Adapter.objects.create(tenant=parties.a, model="nobody-serves-this", name="idle",
                           file="x", sha256="0" * 64, size_bytes=1, rank=1)
    ids = [m["id"] for m in api.get("/v1/models", **bearer(parties.owner)).json()["data"]]
    assert f"{standin.model}:support" in ids and standin.model in ids
    assert f"{standin.model}:secret" not in ids and "nobody-serves-this:idle" not in ids
    assert ids.index(standin.model) < ids.index(f"{standin.model}:support")
    entry = api.get(f"/v1/models/{standin.model}:support", **bearer(parties.member)).json()
    assert entry == {"id": f"{standin.model}:support", "object": "model", "owned_by": "alpha",
                     "parent": standin.model, "embeddings": False,
                     "created": int(rows["support"].created.timestamp())}
    theirs = not_found(api.get(f"/v1/models/{standin.model}:secret", **bearer(parties.owner)),
                       f"{standin.model}:secret")
    nobodys = not_found(api.get(f"/v1/models/{standin.model}:nobody", **bearer(parties.owner)),
                        f"{standin.model}:nobody")
    assert theirs == nobodys
    outsider = [m["id"] for m in api.get("/v1/models", **bearer(parties.outsider)).json()["data"]]
    assert f"{standin.model}:secret" in outsider and f"{standin.model}:support" not in outsider


# -- affinity -----------------------------------------------------------------------------------


def job_of(body: dict, tenant: str = "7", adapter: dict | None = None,
           kind: str = CHAT) -> protocol.Job:
    parsed = parse_request(kind, body)
    parsed.adapter = adapter
    return parsed.job("r", tenant)


def test_adapter_chains_differ_from_the_base_and_across_scales():
    long_text = "All work and no play makes Jack a dull boy. " * 40
    body = {"model": "m", "messages": [{"role": "user", "content": long_text}]}
    ad = {"id": "ad_" + "1" * 16, "path": "/x", "sha256": "ab" * 32, "scale": 1.0}
    base = job_of(body).affinity
    salt = _tenant_salt("7")
    assert base == affinity.chain(salt, affinity.prompt_text(None, body["messages"]))
    assert len(base) > 3  # the base model's chain as it always was
    one = job_of(body, adapter=ad).affinity
    half = job_of(body, adapter={**ad, "scale": 0.5}).affinity
    other_file = job_of(body, adapter={**ad, "sha256": "cd" * 32}).affinity
    tag = protocol.adapter_tag(ad)
    assert one[0] == affinity.adapter_head(salt, tag)
    assert len(one) == min(len(base) + 1, affinity.MAX_PIECES)
    assert not set(one) & set(base) and not set(one) & set(half)
    assert not set(one) & set(other_file)
    assert one == job_of(body, adapter=dict(ad)).affinity  # stable
    assert job_of(body, tenant="8", adapter=ad).affinity[0] != one[0]  # salted per tenant
    huge = {"model": "m", "prompt": "z" * 10**5}
    assert len(job_of(huge, adapter=ad, kind=COMPLETION).affinity) == affinity.MAX_PIECES
    short = {"model": "m", "prompt": "hi"}
    assert job_of(short, kind=COMPLETION).affinity is None  # too short for a piece
    assert job_of(short, adapter=ad, kind=COMPLETION).affinity == [one[0]]  # its head alone


def test_an_adapter_job_goes_to_the_daemon_that_holds_its_head_hash(parties, redis_client):
    """The enqueue's routing (wire/queue.py) matches the head hash a daemon keeps in its
    summary while it has the adapter loaded, even for a prompt too short for a piece."""
    from inference import broker
    from tests.test_queue import fleet
    from wire import queue

    model, holder, other = f"route-{uuid.uuid4().hex[:6]}", "ad-holder", "ad-other"
    for daemon in (holder, other):
        fleet(redis_client, model, daemon, max_queue=50, held=0)
    ad = {"id": "ad_" + "2" * 16, "path": "/x", "sha256": "ef" * 32, "scale": 1.0}
    job = job_of({"model": model, "prompt": "hi"}, "7", ad, COMPLETION)
    redis_client.sadd(affinity.summary_key(holder), job.affinity[0])
    try:
        for _ in range(3):
            queued = job_of({"model": model, "prompt": "hi"}, "7", ad, COMPLETION)
            queued.id = uuid.uuid4().hex
            placed = queue.enqueue(redis_client, queued, route=broker.route_of(queued))
            assert (placed.reason, placed.daemon) == ("affinity", holder)
        base = job_of({"model": model, "prompt": "hi"}, "7", None, COMPLETION)
        assert queue.enqueue(redis_client, base, route=broker.route_of(base)).reason != "affinity"
    finally:
        redis_client.delete(affinity.summary_key(holder), *queue.keys_of(model))
