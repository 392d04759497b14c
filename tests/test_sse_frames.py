"""The SSE body a streamed request gets (inference/api_views.py) for a given run of events,
without a server or a clock: an idle tick is a ``None`` from the follower (one empty read
of ``service.BLOCK_MS``). The keep-alive rule: a lone comment line after
``SSE_KEEPALIVE_S`` idle seconds in a row. The OpenAI SDK reading such a stream is in
test_api_standin.py."""
import uuid

import pytest
from django.test import override_settings

from inference import api_views, service
from inference.broker import StreamEvent
from inference.openai_format import KEEPALIVE_FRAME, OPEN_FRAME, Formatter
from wire import protocol

pytestmark = pytest.mark.asyncio
IDLE = None


def token(n: int, text: str) -> StreamEvent:
    return StreamEvent(f"{n}-0", protocol.TOKEN, {"text": text, "n_tokens": 1})


def done(n: int) -> StreamEvent:
    return StreamEvent(f"{n}-0", protocol.DONE, {
        "finish_reason": "stop", "stop": None, "timings": {}, "usage": protocol.usage(5, 0, 2)})


async def body(events: list, keepalive_s: float) -> list[bytes]:
    async def follow():
        for event in events:
            yield event

    formatter = Formatter("completion", uuid.uuid4().hex, "m", 0)
    # RESUME_GRACE_S 0: no watch key (no Redis); the frames are the same either way
    with override_settings(SSE_KEEPALIVE_S=keepalive_s, RESUME_GRACE_S=0):
        return [frame async for frame in api_views._sse(formatter, follow())]


def ticks(seconds: float) -> int:
    return round(seconds * 1000 / service.BLOCK_MS)


async def test_a_pause_gets_a_keep_alive_per_interval_and_no_blank_line():
    frames = await body([token(1, "Hello"), *[IDLE] * ticks(5), token(2, " world"), done(3)],
                        keepalive_s=2)
    assert frames[0] == OPEN_FRAME
    between = frames[2:frames.index(next(f for f in frames if b'" world"' in f))]
    assert between == [KEEPALIVE_FRAME, KEEPALIVE_FRAME]  # after 2 and 4 idle seconds
    assert KEEPALIVE_FRAME.startswith(b":") and KEEPALIVE_FRAME.count(b"\n") == 1
    assert frames[-1].endswith(b"data: [DONE]\n\n")


async def test_idle_seconds_count_in_a_row_not_over_the_whole_stream():
    events = [token(1, "a")]
    for n in range(2, 8):  # six pauses of one interval less a second, each ended by a token
        events += [IDLE] * ticks(2) + [token(n, "b")]
    frames = await body([*events, done(9)], keepalive_s=3)
    assert KEEPALIVE_FRAME not in frames


async def test_a_long_wait_before_the_first_token_gets_keep_alives_too():
    frames = await body([*[IDLE] * ticks(3), token(1, "Hi"), done(2)], keepalive_s=1)
    assert frames[1:4] == [KEEPALIVE_FRAME] * 3
