"""The API's authentication: one DRF class for every view, the same lookup for websockets
and for the proxy's key check.

``ApiKeyAuthentication`` (REST_FRAMEWORK's default: every /v1/ view, sync or async) reads
``Authorization: Bearer sk-...``, or ``X-Api-Key: sk-...`` (Anthropic's clients) without it;
``key_for`` is the same lookup for async code (the websocket's middleware and its ``auth``
message); ``key_check`` answers nginx's
``auth_request`` (GET /v1/internal/key-check) before it reads a request's body. A key is looked
up in the database (``accounts.authentication.find_key``, on the web's database thread) and
then trusted for ``KEY_CACHE_S`` in this process: a revoked key, or one whose tenant was
deactivated, stops authenticating within that second in every web process, and at once in a
process that changed it through the model (``revoke()``, a save in the admin: the cache
forgets it on ``post_save``/``post_delete``). Open websockets notice within
``WS_REVOCATION_CHECK_S`` (consumers.py), the same second. A key past its ``expires_at``
stops at once: a cached key is checked against it on every use.

A read-only key (``ApiKey.read_only``: history and usage only) authenticates, and any
request but a read (GET, HEAD, OPTIONS) made with it is refused here, 403 ``key_read_only``
(inference, cancels, deletions); the websocket refuses its requests the same way
(``service.check_scope``, which also holds a key to its ``allowed_models``).

Wrong keys cost the database little (both in this process, bounded):
- a key prefix the database does not know is remembered for ``AUTH_NEGATIVE_CACHE_S``, and
  answered without a query until then;
- failed authentications are counted per client address (``REMOTE_ADDR``, the ASGI scope's
  client: daphne's ``--proxy-headers`` makes it the real client behind the proxy; an IPv6
  address counts with its /64). Past ``AUTH_FAILURES_PER_MINUTE`` in a minute the address
  is refused, 429 ``auth_throttled`` with Retry-After, without a query for the rest of that
  minute; only a key this process has cached as good (its prefix and secret) is still
  looked up, so a tenant behind the same address keeps working.
"""
from __future__ import annotations

import ipaddress
import math
import threading
import time
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from channels.middleware import BaseMiddleware
from django.conf import settings
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import SAFE_METHODS
from rest_framework.request import Request

from accounts.authentication import ApiKeyUser, Found, find_key
from accounts.models import ApiKey, Tenant, split_key
from inference import db
from wire.errors import AUTH_THROTTLED, KEY_READ_ONLY

KEYWORD = "Bearer"
NO_KEY = "You didn't provide an API key. Send it as 'Authorization: Bearer sk-...'."
BAD_KEY = "Incorrect API key provided."
THROTTLED = ("Too many failed API key checks from your address; try again in {seconds} s "
             "(a key in use here a moment ago still works).")
READ_ONLY = ("This API key is read-only: it may read the request history, usage and models, "
             "not run or change anything.")
INVALID_API_KEY = "invalid_api_key"  # the code of both refusals (wire.errors.CODES)
API_KEY_HEADER = "X-Api-Key"  # the key-check view's other header (Anthropic's style)
# How long a key read from the database is trusted; at most inference.limits.FRESH_KEY_S,
# so that admission takes the tenant limits loaded with the key.
KEY_CACHE_S = 1.0
MAX_CACHED_KEYS = 10_000
# Defaults of the settings of the same names (settings.AUTH_NEGATIVE_CACHE_S, ...); 0: off.
NEGATIVE_CACHE_S = 30.0
FAILURES_PER_MINUTE = 30
FAILURE_WINDOW_S = 60.0
MAX_UNKNOWN_PREFIXES = 10_000  # the negative cache's size; the oldest go first
MAX_TRACKED_ADDRESSES = 50_000  # addresses whose failures are counted; the quietest go first
# Key lookups in progress at once from one address (checks of keys not cached here); past
# it a check is refused for a second. Lookups of good keys at once (clients reconnecting
# with nothing cached) are not failures: only this bounds them.
PENDING_LOOKUPS_PER_ADDRESS = 64
IPV6_NETWORK_BITS = 64  # an IPv6 client counts with its /64 (one subscriber's addresses)
# The client address for key lookups from async code that has no request at hand (the
# websocket's ``auth`` message): ApiKeyAuthMiddleware sets it for the connection.
client_address: ContextVar[str | None] = ContextVar("client_address", default=None)


def bearer_token(header: str) -> str | None:
    """The key in ``Authorization: Bearer <key>``; None when the header is absent or other."""
    keyword, _, token = header.strip().partition(" ")
    if keyword.lower() != KEYWORD.lower() or not token.strip():
        return None
    return token.strip()


class KeyCache:
    """Usable keys by prefix, as read from the database at ``ApiKey.loaded_at``."""

    def __init__(self) -> None:
        self._keys: dict[str, ApiKey] = {}

    def get(self, raw: str) -> ApiKey | None | bool:
        """The cached key for ``raw``; None when it is not a usable key; False when the
        database must say (not cached, or cached over KEY_CACHE_S ago)."""
        parts = split_key(raw.strip())
        if parts is None:
            return None
        prefix, secret = parts
        api_key = self._keys.get(prefix)
        if api_key is None or time.monotonic() - (api_key.loaded_at or 0) > KEY_CACHE_S:
            return False
        if api_key.is_expired:  # at once, not within KEY_CACHE_S
            self._keys.pop(prefix, None)
            return None
        return api_key if api_key.matches(secret) else None

    def known(self, raw: str) -> bool:
        """Whether ``raw`` is a key this process found good, however long ago (its prefix
        cached and its secret matching): a throttled address may still look it up."""
        parts = split_key(raw.strip())
        api_key = self._keys.get(parts[0]) if parts else None
        return api_key is not None and not api_key.is_expired and api_key.matches(parts[1])

    def put(self, api_key: ApiKey) -> None:
        if len(self._keys) >= MAX_CACHED_KEYS:
            self._keys.clear()
        self._keys[api_key.prefix] = api_key

    def forget(self, prefix: str | None = None, tenant_id: int | None = None) -> None:
        """Drop one key, a tenant's keys, or (no argument) every key."""
        if prefix is None and tenant_id is None:
            self._keys.clear()
        for key in list(self._keys.values()):
            if key.prefix == prefix or key.tenant_id == tenant_id:
                self._keys.pop(key.prefix, None)


class UnknownPrefixes:
    """Key prefixes the database named no key for, each remembered for
    ``AUTH_NEGATIVE_CACHE_S`` (at most ``MAX_UNKNOWN_PREFIXES``, the oldest dropped first)."""

    def __init__(self) -> None:
        self._until: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, prefix: str) -> bool:
        with self._lock:
            until = self._until.get(prefix)
            if until is not None and until <= time.monotonic():
                del self._until[prefix]
                until = None
            return until is not None

    def add(self, prefix: str) -> None:
        ttl_s = _setting("AUTH_NEGATIVE_CACHE_S", NEGATIVE_CACHE_S)
        if ttl_s <= 0:
            return
        with self._lock:
            self._until.pop(prefix, None)
            self._until[prefix] = time.monotonic() + ttl_s
            while len(self._until) > MAX_UNKNOWN_PREFIXES:
                self._until.popitem(last=False)

    def discard(self, prefix: str) -> None:
        with self._lock:
            self._until.pop(prefix, None)

    def clear(self) -> None:
        with self._lock:
            self._until.clear()


class FailedAuthThrottle:
    """Failed authentications per client address, in windows of ``FAILURE_WINDOW_S`` from
    each address's first failure; an address with ``AUTH_FAILURES_PER_MINUTE`` failures in
    its window is refused until the window ends. A lookup is admitted while the address has
    fewer failures than that and fewer than ``PENDING_LOOKUPS_PER_ADDRESS`` lookups in
    progress; it counts as a failure when it finds no usable key. So checks of good keys
    at once (clients reconnecting after a restart, with nothing cached) are never refused
    for being many, and one address makes at most limit - 1 + PENDING_LOOKUPS_PER_ADDRESS
    lookups of wrong keys in a window. Refusals cost no lookup; they are counted to tell a
    flood (``flooding``) from a client that keeps retrying a wrong key. At most
    ``MAX_TRACKED_ADDRESSES`` windows are kept, the longest quiet dropped first."""

    def __init__(self) -> None:
        # address: [window start, failures, refusals since the limit]
        self._windows: OrderedDict[str, list[float]] = OrderedDict()
        self._pending: dict[str, int] = {}  # address: lookups in progress
        self._lock = threading.Lock()

    def admit(self, address: str | None) -> int | None:
        """Admit one check about to run (``finish`` ends it); None when it may run, else
        the seconds until the address may try again."""
        limit = int(_setting("AUTH_FAILURES_PER_MINUTE", FAILURES_PER_MINUTE))
        if limit <= 0:
            return None
        key, now = client_key(address), time.monotonic()
        with self._lock:
            window = self._window(key, now)
            if window[1] >= limit:
                window[2] += 1
                return max(1, math.ceil(window[0] + FAILURE_WINDOW_S - now))
            pending = self._pending.get(key, 0)
            if pending >= PENDING_LOOKUPS_PER_ADDRESS:
                return 1  # the lookups in progress end within a second or so
            self._pending[key] = pending + 1
        return None

    def finish(self, address: str | None, failed: bool) -> None:
        """An admitted check ended: a failure when it found no usable key."""
        key, now = client_key(address), time.monotonic()
        with self._lock:
            left = self._pending.pop(key, 0) - 1
            if left > 0:
                self._pending[key] = left
            if failed:
                self._window(key, now)[1] += 1

    def fail(self, address: str | None) -> int | None:
        """A check that failed without a lookup (no key at all, a prefix known to be
        unknown): counted, or refused as ``admit`` refuses (its Retry-After)."""
        wait_s = self.admit(address)
        if wait_s is None:
            self.finish(address, failed=True)
        return wait_s

    def flooding(self, address: str | None) -> bool:
        """The address, throttled, has been refused as many times again in its window as
        it may fail: a flood, not a client retrying one wrong key. The door then refuses
        it alone, every key from that address, until the window ends (``key_check``)."""
        limit = int(_setting("AUTH_FAILURES_PER_MINUTE", FAILURES_PER_MINUTE))
        with self._lock:
            window = self._windows.get(client_key(address))
            return (limit > 0 and window is not None
                    and time.monotonic() - window[0] < FAILURE_WINDOW_S and window[2] >= limit)

    def _window(self, key: str, now: float) -> list[float]:
        """The address's window (a new one past FAILURE_WINDOW_S), now the most recent."""
        window = self._windows.pop(key, None)
        if window is None or now - window[0] >= FAILURE_WINDOW_S:
            window = [now, 0, 0]
        self._windows[key] = window
        while len(self._windows) > MAX_TRACKED_ADDRESSES:
            self._windows.popitem(last=False)
        return window

    def clear(self) -> None:
        with self._lock:
            self._windows.clear()
            self._pending.clear()


keys = KeyCache()
unknown_prefixes = UnknownPrefixes()
failures = FailedAuthThrottle()


class KeyReadOnly(exceptions.APIException):
    """403 ``key_read_only``: a read-only key asked for more than a read."""

    status_code = 403
    default_code = KEY_READ_ONLY

    def __init__(self) -> None:
        super().__init__(READ_ONLY, KEY_READ_ONLY)


class AuthThrottled(exceptions.APIException):
    """429 ``auth_throttled``: the client's address failed too many key checks (DRF's
    handler sends ``wait`` as Retry-After)."""

    status_code = 429
    default_code = AUTH_THROTTLED

    def __init__(self, wait_s: int) -> None:
        super().__init__(THROTTLED.format(seconds=wait_s), AUTH_THROTTLED)
        self.wait = wait_s


def client_key(address: str | None) -> str:
    """The address failures are counted under: an IPv4 address (also one mapped into IPv6),
    an IPv6 address's /64, or the address as given when it is not one."""
    try:
        ip = ipaddress.ip_address((address or "").strip())
    except ValueError:
        return address or "unknown"
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/{IPV6_NETWORK_BITS}", strict=False))
    return str(ip)


@dataclass(slots=True)
class _Ask:
    """The database must say; ``admitted``: by the throttle (``finish`` ends it)."""

    admitted: bool


def _before_database(raw: str, address: str | None) -> ApiKey | None | _Ask:
    """What this process knows without a query: the cached key; None for a key known bad
    (a failure counted); ``_Ask`` when the database must say. Every check but one of a key
    cached as good passes the throttle first; raises ``AuthThrottled`` when the address is
    refused."""
    found = keys.get(raw)
    if found:
        return found
    if keys.known(raw):  # a good key whose cached copy is over KEY_CACHE_S old
        return _Ask(admitted=False)
    parts = split_key(raw.strip())
    if found is None or parts is None or parts[0] in unknown_prefixes:
        wait_s = failures.fail(address)
        if wait_s is not None:
            raise AuthThrottled(wait_s)
        return None
    wait_s = failures.admit(address)
    if wait_s is not None:
        raise AuthThrottled(wait_s)
    return _Ask(admitted=True)


def _after_database(raw: str, address: str | None, ask: _Ask, found: Found) -> ApiKey | None:
    if found.api_key is not None:
        keys.put(found.api_key)
        if ask.admitted:
            failures.finish(address, failed=False)
        return found.api_key
    parts = split_key(raw.strip())
    if parts is not None and not found.prefix_exists:
        unknown_prefixes.add(parts[0])
    if ask.admitted:
        failures.finish(address, failed=True)
    else:  # a key found good before, revoked since: a failure all the same
        failures.fail(address)
    return None


def _lookup_failed(address: str | None, ask: _Ask) -> None:
    """The lookup itself raised (the database): the check ends, not counted as a failure."""
    if ask.admitted:
        failures.finish(address, failed=False)


def lookup(raw: str, address: str | None = None) -> ApiKey | None:
    """The usable key for a plaintext key; from sync code (DRF's request thread). Raises
    ``AuthThrottled`` when ``address`` is refused."""
    found = _before_database(raw, address)
    if not isinstance(found, _Ask):
        return found
    try:
        row = db.call(find_key, raw)
    except BaseException:
        _lookup_failed(address, found)
        raise
    return _after_database(raw, address, found, row)


async def check_key(raw: str, address: str | None) -> ApiKey | None:
    """``lookup`` for async code."""
    found = _before_database(raw, address)
    if not isinstance(found, _Ask):
        return found
    try:
        row = await db.run(find_key, raw)
    except BaseException:
        _lookup_failed(address, found)
        raise
    return _after_database(raw, address, found, row)


async def key_for(raw: str) -> ApiKey | None:
    """``check_key`` for the connection's client address (``client_address``); None when
    the key is not usable. Raises ``AuthThrottled`` when the address is throttled."""
    return await check_key(raw, client_address.get())


def _setting(name: str, default: float) -> float:
    value = getattr(settings, name, None)
    return default if value is None else value


@receiver(post_save, sender=ApiKey)
@receiver(post_delete, sender=ApiKey)
def _forget_key(sender: type, instance: ApiKey, **kwargs: Any) -> None:
    keys.forget(prefix=instance.prefix)
    unknown_prefixes.discard(instance.prefix)


@receiver(post_save, sender=Tenant)
@receiver(post_delete, sender=Tenant)
def _forget_tenant(sender: type, instance: Tenant, **kwargs: Any) -> None:
    keys.forget(tenant_id=instance.pk)


class ApiKeyAuthentication(BaseAuthentication):
    """DRF authentication by API key (``Authorization: Bearer``, else ``X-Api-Key``):
    ``request.auth`` is the ``ApiKey``, ``request.user`` an ``ApiKeyUser``. No header: None
    (the permission check answers 401 ``NO_KEY``); any other header that is not a usable
    key: 401 ``BAD_KEY``; from a throttled address: 429 ``auth_throttled``; a read-only
    key on a method that is not a read: 403 ``key_read_only``. DRF calls
    ``authenticate`` on the request's thread (adrf's async views too), which waits for the
    database thread when the key is not cached."""

    def authenticate(self, request: Request) -> tuple[ApiKeyUser, ApiKey] | None:
        header = request.headers.get("Authorization", "")
        if not header:  # Anthropic's clients send the key as X-Api-Key
            api_key_header = request.headers.get(API_KEY_HEADER, "").strip()
            if not api_key_header:
                return None
            header = f"{KEYWORD} {api_key_header}"
        token = bearer_token(header)
        address = request.META.get("REMOTE_ADDR")
        api_key = lookup(token, address) if token else _known_bad(address)
        if api_key is None:
            raise exceptions.AuthenticationFailed(BAD_KEY, INVALID_API_KEY)
        if api_key.read_only and request.method not in SAFE_METHODS:
            raise KeyReadOnly()
        return ApiKeyUser(api_key), api_key

    def authenticate_header(self, request: Request) -> str:
        return KEYWORD


def _known_bad(address: str | None) -> None:
    """A credential that is no key at all (``Authorization: Basic ...``): refused without a
    query and counted as a failure, as a wrong key is."""
    wait_s = failures.fail(address)
    if wait_s is not None:
        raise AuthThrottled(wait_s)


class ApiKeyAuthMiddleware(BaseMiddleware):
    """Websocket scopes: ``scope["api_key"]`` is the key from an Authorization header
    (None without one: the client may send ``{"type": "auth"}`` first);
    ``scope["auth_error"]`` is set when a header was sent but did not authenticate (or the
    address is throttled). The connection's client address is ``client_address`` for the
    ``auth`` message's lookup."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        scope = dict(scope, api_key=None, auth_error=None)
        address = (scope.get("client") or [None])[0]
        client_address.set(address)
        headers = dict(scope.get("headers") or [])
        raw = headers.get(b"authorization", b"").decode("latin1")
        if raw:
            token = bearer_token(raw)
            try:
                scope["api_key"] = (await check_key(token, address) if token
                                    else _known_bad(address))
            except AuthThrottled as refused:
                scope["auth_error"] = str(refused.detail)
                scope["auth_error_code"] = AUTH_THROTTLED
            else:
                if scope["api_key"] is None:
                    scope["auth_error"] = BAD_KEY
        return await super().__call__(scope, receive, send)


@csrf_exempt
async def key_check(request: HttpRequest) -> HttpResponse:
    """GET /v1/internal/key-check: nginx's ``auth_request``, before it reads a request's body.
    The key comes from ``Authorization: Bearer`` or ``X-Api-Key``. 204: a usable key; 401
    with ``X-Refusal: invalid_api_key``: none, or not usable; 403 with ``X-Refusal:
    auth_throttled`` and Retry-After: the address is throttled (auth_request passes only
    2xx, 401 and 403 on; the proxy writes the API's error body from ``X-Refusal``). Once
    the throttled address floods (``FailedAuthThrottle.flooding``), the 403 carries
    ``X-Accel-Expires``: the door keeps it for the address until the window ends and asks
    no more; before, each check is answered here, so a good key this process knows still
    passes from that address (another client behind the same NAT)."""
    address = request.META.get("REMOTE_ADDR")
    header = request.headers.get("Authorization", "")
    token = bearer_token(header) if header else request.headers.get(API_KEY_HEADER, "").strip()
    try:
        api_key = (await check_key(token, address) if token
                   else _known_bad(address) if header else None)
    except AuthThrottled as refused:
        response = HttpResponse(status=403)
        response["X-Refusal"] = AUTH_THROTTLED
        response["Retry-After"] = str(refused.wait)
        if failures.flooding(address):  # the door keeps this answer for the address that long
            response["X-Accel-Expires"] = str(refused.wait)
        return response
    if api_key is None:
        response = HttpResponse(status=401)
        response["X-Refusal"] = INVALID_API_KEY
        return response
    return HttpResponse(status=204)
