"""Protocol events as OpenAI response bodies, stream chunks and SSE frames."""
from __future__ import annotations

import array
import base64
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from inference.broker import StreamEvent
from inference.errors import ApiError
from inference.openai_request import CHAT
from inference.tools import ToolPlan, read_reply
from wire import protocol
from wire.errors import TIMEOUT

DONE_FRAME = b"data: [DONE]\n\n"
# A comment line and no blank line: a blank line ends an event, and the OpenAI Python SDK
# hands a client an event for a blank line once any event had an id (it keeps the last id,
# as the SSE spec says, but does not check that the event has data), then fails to parse
# its empty data: a keep-alive between two chunks ended the SDK's stream with a
# JSONDecodeError. A comment line alone is ignored by every SSE parser.
KEEPALIVE_FRAME = b": keep-alive\n"
OPEN_FRAME = b": stream\n\n"


@dataclass(frozen=True, slots=True)
class Formatter:
    """Builds one request's replies; ``kind`` is "chat" or "completion"; ``n`` choices."""

    kind: str
    request_id: str
    model: str
    created: int
    include_usage: bool = False
    tools: ToolPlan | None = None  # a chat with tools: its output is read as a call
    n: int = 1
    session_id: str | None = None  # a session's turn: every body and chunk names it
    # completions' text_offset runs on across a stream's chunks, per choice
    _offset: dict[int, int] = field(default_factory=dict, compare=False, repr=False)
    # a tools reply's text, held until its end (a call is sent whole)
    _held: list[str] = field(default_factory=list, compare=False, repr=False)

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.kind == CHAT else 'cmpl'}-{self.request_id}"

    def whole(self, texts: list[str], final: StreamEvent,
              logprobs: list[list[dict[str, Any]]] | None = None) -> dict[str, Any]:
        """The non-streaming body: one choice per text (by index). An ``error`` final event
        raises ApiError instead; a ``timeout`` one carries the text made until then and its
        (billed) usage. ``logprobs``: per choice, the wire's entries of every token (a
        request that asked for them)."""
        if final.kind == protocol.ERROR:
            error = ApiError.from_event(final.data)
            if error.code == TIMEOUT:
                error.details.update(partial_text=texts[0] if len(texts) == 1 else texts,
                                     usage=usage_of(final))
            raise error
        reasons = _reasons(final, len(texts))
        choices = []
        for index, text in enumerate(texts):
            reason = reasons[index]
            entries = logprobs[index] if logprobs else None
            if self.kind == CHAT:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if self.tools is not None:
                    content, calls = read_reply(text, self.tools)
                    message["content"] = content
                    if calls:
                        message["tool_calls"] = calls
                        reason = "tool_calls" if reason == "stop" else reason
                choice = {"index": index, "message": message, "finish_reason": reason,
                          "logprobs": self._logprobs(entries, index)}
            else:
                choice = {"index": index, "text": text, "finish_reason": reason,
                          "logprobs": self._logprobs(entries, index)}
            choices.append(choice)
        body = {**self._head(whole=True), "choices": choices, "usage": usage_of(final)}
        if self.n > 1:  # how the prompt was computed: once, the other choices copied it
            body["timings"] = final.data.get("timings") or {}
        return body

    def chunks(self, event: StreamEvent) -> list[dict[str, Any]]:
        """The stream chunks one event becomes (possibly none)."""
        if event.kind == protocol.ACCEPTED:
            if self.kind == CHAT:
                return [self._chunk({"role": "assistant", "content": ""}, index=i)
                        for i in range(self.n)]
            echo = event.data.get("echo")  # a completion that asked for its prompt back
            if not echo:
                return []
            return [self._chunk(echo if isinstance(echo, str) else str(echo[i]), index=i)
                    for i in range(self.n) if isinstance(echo, str) or i < len(echo)]
        if event.kind == protocol.TOKEN:
            index = event.data.get("index") or 0
            text = event.data.get("text", "")
            if self.tools is not None:  # the call goes out whole, at the end
                self._held.append(text)
                text = ""
            logprobs = self._logprobs(event.data.get("logprobs"), index)
            if not text and logprobs is None:
                return []
            return [self._chunk({"content": text} if self.kind == CHAT else text,
                                logprobs=logprobs, index=index)]
        if event.kind == protocol.DONE:
            reasons = _reasons(event, self.n)
            out = []
            if self.tools is not None:
                content, calls = read_reply("".join(self._held), self.tools)
                if calls:
                    out.append(self._chunk({"tool_calls": [{"index": i, **call}
                                                           for i, call in enumerate(calls)]}))
                    reasons[0] = "tool_calls" if reasons[0] == "stop" else reasons[0]
                elif content:
                    out.append(self._chunk({"content": content}))
            out += [self._chunk({} if self.kind == CHAT else "", reasons[i], index=i)
                    for i in range(self.n)]
            if self.include_usage:
                out.append({**self._head(), "choices": [], "usage": usage_of(event)})
            return out
        if event.kind == protocol.ERROR:
            return [ApiError.from_event(event.data).body()]
        return []

    def _head(self, whole: bool = False) -> dict[str, Any]:
        if self.kind == CHAT:
            kind = "chat.completion" if whole else "chat.completion.chunk"
        else:
            kind = "text_completion"
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        if self.session_id is not None:
            head["session_id"] = self.session_id
        if not whole and self.include_usage:
            head["usage"] = None
        return head

    def _chunk(self, delta: dict[str, Any] | str, reason: str | None = None,
               logprobs: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.kind == CHAT:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice.update(finish_reason=reason, logprobs=logprobs)
        return {**self._head(), "choices": [choice]}

    def _logprobs(self, entries: list[dict[str, Any]] | None,
                  index: int = 0) -> dict[str, Any] | None:
        """The wire's logprobs entries in OpenAI's shape (None: the request asked none).
        Chat: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}``.
        Completions: ``tokens``, ``token_logprobs``, ``top_logprobs`` (token -> logprob)
        and ``text_offset`` (each token's start in the choice's text, counted in
        characters of the tokens' text, which is the text unless a token ends inside a
        UTF-8 character)."""
        if not entries:
            return None
        if self.kind == CHAT:
            return {"content": [chat_logprob(e) for e in entries], "refusal": None}
        tokens, offsets = [], []
        for entry in entries:
            tokens.append(_piece(entry["b"])[0])
            offsets.append(self._offset.get(index, 0))
            self._offset[index] = offsets[-1] + len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [e["lp"] for e in entries],
                "top_logprobs": [{_piece(b)[0]: lp for b, lp in reversed(e["top"])}
                                 for e in entries],
                "text_offset": offsets}


def _reasons(final: StreamEvent, n: int) -> list[str | None]:
    """Each choice's finish reason (a request of several lists them; else the one)."""
    reasons: list[str | None] = [final.data.get("finish_reason")] * n
    for choice in final.data.get("choices") or ():
        if isinstance(choice, dict) and type(choice.get("index")) is int and 0 <= choice[
                "index"] < n:
            reasons[choice["index"]] = choice.get("finish_reason")
    return reasons


def _piece(hex_bytes: str) -> tuple[str, list[int]]:
    """A token's text (undecodable bytes replaced) and its bytes, from the wire's hex."""
    raw = bytes.fromhex(hex_bytes)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprob(entry: dict[str, Any]) -> dict[str, Any]:
    token, raw = _piece(entry["b"])
    top = []
    for hex_bytes, logprob in entry["top"]:
        text, alt_raw = _piece(hex_bytes)
        top.append({"token": text, "logprob": logprob, "bytes": alt_raw})
    return {"token": token, "logprob": entry["lp"], "bytes": raw, "top_logprobs": top}


def embeddings_body(model: str, vectors: list[str], encoding: str,
                    prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's embeddings list from the daemon's vectors (base64 of little-endian float32):
    as floats, or as that base64 (``encoding_format: "base64"``, what the SDK decodes)."""
    data = []
    for i, vector in enumerate(vectors):
        if encoding == "base64":
            embedding: Any = vector
        else:
            values = array.array("f", base64.b64decode(vector))
            if sys.byteorder == "big":
                values.byteswap()
            embedding = values.tolist()
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def usage_of(event: StreamEvent) -> dict[str, Any]:
    """The event's OpenAI ``usage`` (zeros when the daemon sent none)."""
    return event.data.get("usage") or protocol.usage(0, 0, 0)


def sse_frame(entry_id: str | None, payload: dict[str, Any]) -> bytes:
    """One SSE event; its id is the Redis entry id, so Last-Event-ID resumes after it."""
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    head = f"id: {entry_id}\n" if entry_id else ""
    return f"{head}data: {data}\n\n".encode()

