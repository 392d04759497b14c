"""A job's affinity: where in a fleet its prompt's prefix is likely cached, told without
its text and without anything another tenant could match.

The web does not tokenize. It cuts the leading text of a prompt (a completion's prompt, or
the chat messages in a canonical form) into pieces of ``PIECE_CHARS`` characters and
hashes them as a chain: ``h[i] = H(salt_t, h[i-1] || piece[i])``, where ``salt_t`` is an
HMAC of the tenant id under a key derived from the service's secret. Only whole pieces
count (at most ``MAX_PIECES``). So:

- two jobs of one tenant whose prompts share the first k pieces share the first k hashes;
- the same text sent by another tenant hashes to other values (another salt): a daemon's
  summary of what tenant A sent never matches anything tenant B sends, and a hash reveals
  nothing about the text without the secret;
- the session (``session`` or ``user``) is hashed under the same salt for its key;
- a job with an adapter (``protocol.adapter_tag``: the file's hash and the scale) hashes
  its pieces under a salt of the tenant's and the tag's, so a prefix computed under one
  adapter and scale never matches another's or the base model's; its chain starts with a
  head hash of the tenant and the tag alone (``adapter_head``), which a daemon keeps in its
  summary while it has that adapter loaded: a job whose text matches nowhere still goes to
  a daemon that has its adapter (``job_chain``).

Daemons record the chains of the jobs they start in their summary
(``llm:affinity:<daemon>``, bounded per tenant: ``scheduler_daemon/core/affinity.py``); the
web's enqueue script routes by the longest match (``wire/queue.py``).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from .protocol import PREFIX

PIECE_CHARS = 256
MAX_PIECES = 32  # 8 KiB of leading text at most
HASH_BYTES = 8  # 16 hex characters: collisions within one tenant's summary are negligible
_ROLE, _END = "\x1f", "\x1e"  # unit and record separators: no message text holds them raw


def summary_key(daemon_id: str) -> str:
    """A daemon's set of chain hashes (every tenant's, each salted by its tenant)."""
    return f"{PREFIX}:affinity:{daemon_id}"


def session_key(model: str, session_hash: str) -> str:
    """Which daemon served a session's last turn (its id), for a while."""
    return f"{PREFIX}:session:{model}:{session_hash}"


def tenant_salt(secret: str, tenant_id: str) -> bytes:
    """The tenant's salt: an HMAC of its id under a key derived from ``secret``."""
    key = hashlib.sha256(b"llm-affinity\x00" + secret.encode()).digest()
    return hmac.new(key, tenant_id.encode(), hashlib.sha256).digest()


def prompt_text(prompt: Any, messages: list[dict[str, Any]] | None,
                prompts: list[Any] | None = None) -> str:
    """The leading text the chain is cut from: chat messages as ``role US content RS``
    each, a completion's prompt (its first, for several), token ids as decimal text."""
    if messages is not None:
        return "".join(f"{m.get('role', '')}{_ROLE}{m.get('content', '')}{_END}"
                       for m in messages)
    if prompts:
        prompt = prompts[0]
    if isinstance(prompt, list):
        return ",".join(str(t) for t in prompt) + ","
    return prompt if isinstance(prompt, str) else ""


def chain(salt: bytes, text: str) -> list[str]:
    """The hashes of the text's whole leading pieces, chained (at most MAX_PIECES)."""
    out: list[str] = []
    previous = b""
    for start in range(0, min(len(text), PIECE_CHARS * MAX_PIECES), PIECE_CHARS):
        piece = text[start:start + PIECE_CHARS]
        if len(piece) < PIECE_CHARS:
            break
        digest = hashlib.blake2b(previous + piece.encode("utf-8", "surrogatepass"),
                                 key=salt[:64], digest_size=HASH_BYTES).digest()
        out.append(digest.hex())
        previous = digest
    return out


def session_hash(salt: bytes, session: str) -> str:
    return hashlib.blake2b(b"session\x00" + session.encode("utf-8", "surrogatepass"),
                           key=salt[:64], digest_size=HASH_BYTES).hexdigest()


def adapter_salt(salt: bytes, tag: str) -> bytes:
    """The salt of a tenant's jobs under an adapter (``tag``: ``protocol.adapter_tag``)."""
    return hmac.new(salt, b"adapter\x00" + tag.encode(), hashlib.sha256).digest()


def adapter_head(salt: bytes, tag: str) -> str:
    """The hash an adapter job's chain starts with: the tenant's and the adapter's alone."""
    return hashlib.blake2b(b"adapter-head\x00" + tag.encode(), key=salt[:64],
                           digest_size=HASH_BYTES).hexdigest()


def job_chain(salt: bytes, text: str, tag: str = "") -> list[str]:
    """A job's affinity chain: ``chain`` of its text under the tenant's salt (the base
    model: ``tag`` ""), or, under an adapter, its head hash then the chain under
    ``adapter_salt`` (at most MAX_PIECES in all)."""
    if not tag:
        return chain(salt, text)
    return [adapter_head(salt, tag), *chain(adapter_salt(salt, tag), text)][:MAX_PIECES]
