"""POST /v1/embeddings (#16) with the official ``openai`` SDK: computed by the model's daemon
in its loop (a second llama.cpp context, mean pooling, normalized), never in the web. Real
daphne, Redis and daemons (Gemma; SmolLM2 for /v1/models)."""
from __future__ import annotations

import base64
import math
import struct

import openai
import pytest

from config.models import SMOLLM2
from tests.live_service import openai_client, shared_daemon

pytestmark = pytest.mark.slow


def cosine(a, b) -> float:
    return sum(x * y for x, y in zip(a, b, strict=False))


def test_the_same_text_twice_gives_identical_unit_vectors(web, daemon):
    api = openai_client(web)
    one = api.embeddings.create(model=daemon.model, input="a cat sat on the mat")
    two = api.embeddings.create(model=daemon.model, input="a cat sat on the mat")
    assert one.data[0].embedding == two.data[0].embedding
    vector = one.data[0].embedding
    assert len(vector) == 640  # Gemma 3 270M's n_embd
    assert math.isclose(math.sqrt(sum(x * x for x in vector)), 1.0, abs_tol=1e-5)
    assert one.usage.prompt_tokens == one.usage.total_tokens > 0


def test_base64_decodes_to_the_same_floats(web, daemon):
    api = openai_client(web)
    floats = api.embeddings.create(model=daemon.model, input="hello there").data[0].embedding
    raw = api.embeddings.with_raw_response.create(model=daemon.model, input="hello there",
                                                  encoding_format="base64").http_response.json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == floats


def test_a_cat_on_a_mat_is_closer_to_a_cat_on_a_rug_than_to_tax_deadlines(web, daemon):
    reply = openai_client(web).embeddings.create(model=daemon.model, input=[
        "a cat sat on the mat", "a cat sat on a rug", "quarterly tax filing deadlines"])
    mat, rug, tax = (d.embedding for d in reply.data)
    assert [d.index for d in reply.data] == [0, 1, 2]
    assert cosine(mat, rug) > cosine(mat, tax)


def test_token_arrays_and_many_inputs_in_order(web, daemon):
    texts = [f"sentence number {i} about trains" for i in range(20)]  # more than one batch
    api = openai_client(web)
    reply = api.embeddings.create(model=daemon.model, input=texts)
    assert [d.index for d in reply.data] == list(range(20))
    solo = api.embeddings.create(model=daemon.model, input=texts[7]).data[0].embedding
    assert cosine(solo, reply.data[7].embedding) > 0.999  # batch shape shifts the last bits
    ids = api.embeddings.create(model=daemon.model, input=[[2, 651, 5866], [2, 651]])
    assert len(ids.data) == 2 and ids.usage.prompt_tokens == 5


def test_models_say_which_embed(web, daemon):
    listed = {m.id: m.model_extra.get("embeddings") for m in openai_client(web).models.list()}
    assert listed[daemon.model] is True


def test_usage_counts_against_the_tenant(web, daemon):
    import json
    import urllib.request

    def used() -> int:
        request = urllib.request.Request(f"{web.base_url}/v1/usage",
                                         headers={"Authorization": f"Bearer {web.keys['owner']}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())["totals"]["prompt_tokens"]

    before = used()
    reply = openai_client(web).embeddings.create(model=daemon.model,
                                                 input="count these tokens please")
    assert used() - before == reply.usage.prompt_tokens


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input[0]"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input[0]"),
    ({"input": [[-1]]}, "input[0]"),
    ({"input": [[10**9]]}, "input[0]"),  # the daemon: outside the vocabulary
    ({"input": ["x"] * 257}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "word " * 3000}, "input[0]"),  # past the embeddings context (2048 tokens)
])
def test_bad_inputs_are_400s_naming_the_field(web, daemon, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(web).embeddings.create(model=daemon.model, **body)
    assert caught.value.body["param"] == param, caught.value.body


def test_a_lone_surrogate_is_a_400(web, daemon):
    import json
    import urllib.error
    import urllib.request

    body = (f'{{"model": {json.dumps(daemon.model)}, "input": ["ok", "\\ud800"]}}').encode()
    request = urllib.request.Request(f"{web.base_url}/v1/embeddings", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {web.keys['owner']}"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 400
    assert json.loads(caught.value.read())["error"]["param"] == "input[1]"


def test_the_chat_model_embeds_too(web):
    shared_daemon(web, "chat")
    reply = openai_client(web).embeddings.create(model=SMOLLM2, input="hello")
    assert len(reply.data[0].embedding) == 576


# -- #31: a burst of embeddings never starves another tenant; the overflow case ------------

BURST = 10
BURST_INPUT = [[651] * 2048] * 7  # 7 x 2,048 ids: within the limits, 112 decodes of 128


def test_another_tenant_is_served_while_an_embeddings_burst_runs(web):
    """One tenant's 10 x 7 x 2,048 ids against a daemon whose intake holds 4 jobs
    (N_PARALLEL 2 + LOCAL_QUEUE 2): the other tenant's chat and its one-input embeddings
    are both answered before the burst's first request finishes (its 112 embeddings
    decodes; the chat needs its prompt and 8 ticks, taking turns with embeddings by time;
    the one input waits for at most the 2,048-token input open at its arrival: tenants take
    turns by decode, and at N_CTX 2048 the context holds one whole input). The burst's jobs
    past the tenant's EMBEDDINGS_TENANT_TOKENS get 429
    ``tenant_queue_full`` with a Retry-After; the ones held are cut short by the daemon's
    stop at the end (the deadline below is only a backstop: it is never what passes)."""
    import threading
    import time

    from tests.live_service import RealDaemon, wait_until

    daemon = RealDaemon(web, f"gemma-burst-{threading.get_ident() % 10**6}",
                        LOCAL_QUEUE="2").start()
    burst: list[tuple[int, dict, float]] = []
    lock = threading.Lock()

    def send_one() -> None:
        reply = web.request("POST", "/v1/embeddings", {"model": daemon.model,
                                                      "input": BURST_INPUT},
                            key=web.keys["owner"], timeout=1800)
        status, retry_after = reply.status, reply.header("Retry-After")
        body = reply.json()
        with lock:
            burst.append((status, {"body": body, "retry_after": retry_after},
                          time.monotonic()))

    threads = [threading.Thread(target=send_one, daemon=True) for _ in range(BURST)]
    try:
        for thread in threads:
            thread.start()
        # the daemon has answered every burst request it will not hold (429s) and holds the
        # rest: they are running or waiting in it, not in Redis
        wait_until(lambda: len(burst) >= BURST - 4 and all(s == 429 for s, _, _ in burst),
                   timeout_s=300)
        refused = [extra for status, extra, _ in burst if status == 429]
        assert all(r["body"]["error"]["code"] == "tenant_queue_full" and
                   int(r["retry_after"]) >= 1 for r in refused)
        held = BURST - len(refused)
        assert held >= 4  # at least the intake's 4: the old count would have been full

        api = openai_client(web, web.keys["outsider"])
        chat = api.chat.completions.create(
            model=daemon.model, max_tokens=8, temperature=0, timeout=600,
            messages=[{"role": "user", "content": "Say hello."}])
        chat_at = time.monotonic()
        one = api.embeddings.create(model=daemon.model, input="a cat sat on the mat",
                                    timeout=600)
        one_at = time.monotonic()
        assert chat.usage.completion_tokens >= 1 and len(one.data[0].embedding) == 640
        with lock:
            finished = [at for status, _, at in burst if status != 429]
        assert not finished or min(finished) > max(chat_at, one_at), \
            "the other tenant waited for the burst"
        assert len(finished) == 0  # none of the burst's held requests had finished
    finally:
        daemon.stop()  # the held burst requests end (shutting_down / interrupted)
        for thread in threads:
            thread.join(timeout=120)


def test_a_full_context_input_between_two_others_answers_200(web, daemon):
    # #31: this failed with 500 engine_error after ~40 s ("failed to find a memory slot")
    api = openai_client(web)
    reply = api.embeddings.create(model=daemon.model, timeout=900,
                                  input=[[651] * 100, [651] * 2048, [651] * 10])
    assert [d.index for d in reply.data] == [0, 1, 2]
    assert reply.usage.prompt_tokens == 2158
