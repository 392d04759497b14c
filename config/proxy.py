"""The door: nginx in front of daphne, with its limits (standard library only, like
``config.listen``: ``scripts/dev.py`` and compose's proxy service run it before Django).

Every byte a client sends reaches nginx first. daphne reads a whole request body (into a
temporary file, chunked or not, without a limit) before Django sees the request, and it
has no deadline for a request's head; nginx has both, and ``auth_request``:

- a request to the API (``/v1/`` but health, the schema, the docs and metrics) is first
  checked by a body-less subrequest to ``/v1/internal/key-check`` (``inference/auth.py``'s
  ``key_check``): a missing, unknown or throttled key is refused before one byte of the
  body is read (what a client sends anyway is read and dropped, never stored or passed on);
- an address the key check throttles (too many failed keys) and that keeps sending them (a
  flood) is refused by nginx itself, from a cache of that answer keyed by the address, for
  as long as its Retry-After says: a flood of wrong keys costs daphne nothing once it is
  throttled;
- no body is read past ``DATA_UPLOAD_MAX_MEMORY_SIZE`` (Django's own limit, the same
  number), with or without a key, chunked or not;
- a request head must arrive within ``PROXY_HEADER_TIMEOUT_S``; a body that stops arriving
  is cut after ``PROXY_BODY_TIMEOUT_S``; an idle keep-alive connection is closed after
  ``PROXY_KEEPALIVE_S``; a client that reads nothing for ``PROXY_SEND_TIMEOUT_S`` is cut;
- one address has at most ``PROXY_CONNS_PER_ADDRESS`` requests in progress at once;
- one key sends at most ``PROXY_REQUESTS_PER_S`` API requests a second (and one address as
  many to the anonymous API), past a burst of ``PROXY_REQUEST_BURST``: a tenant's flood
  (replays, refused requests) is refused by nginx before it costs daphne a thing;
- nginx's own refusals are answered in the API's error shape, from ``wire/errors.py``.

daphne then listens where only nginx reaches it (unix sockets in ``make run`` and the
tests, one per web process; the compose network in compose), nginx spreading requests over
its processes by the fewest in progress (``least_conn``: config/web_procs.py), and takes
the client's address from nginx's ``X-Forwarded-For`` (``--proxy-headers``), which nginx
sets, never appends to.

``python -m config.proxy --listen HOST:PORT --upstream ADDRESS`` writes the configuration
and runs nginx in the foreground (compose's proxy service).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script by compose
    sys.path.insert(0, str(ROOT))

from wire import errors  # noqa: E402  (wire/errors.py: standard library only)

# Defaults of the settings of the same names (docs/security.md).
DATA_UPLOAD_MAX_MEMORY_SIZE = 2_621_440  # bytes of one request body (Django's and nginx's)
PROXY_HEADER_TIMEOUT_S = 10  # a request head must arrive whole within this
PROXY_BODY_TIMEOUT_S = 10  # the longest pause between two reads of a body
PROXY_KEEPALIVE_S = 30  # an idle keep-alive connection is closed after this
PROXY_SEND_TIMEOUT_S = 60  # the longest pause of a client that does not read its answer
PROXY_CONNS_PER_ADDRESS = 256  # requests in progress at once from one client address
PROXY_REQUESTS_PER_S = 20  # API requests a second per key (anonymous API: per address)
PROXY_REQUEST_BURST = 60  # requests past that rate let in at once (the first 20 undelayed)
PROXY_WORKERS = 1  # nginx worker processes (one holds thousands of connections)
# A refused request's body still arriving is read and dropped (never stored) this long at
# most, so that the client sees the answer rather than a reset.
LINGERING_S = 5
# How long a stream may go without a byte from daphne (streams send keep-alive comments).
STREAM_READ_TIMEOUT_S = 3600
WORKER_CONNECTIONS = 8192
NGINX_PATHS = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx")

# API paths a client reaches without a key (exact paths, under /v1/).
ANONYMOUS_API = ("health", "openapi.json", "docs", "metrics")
KEY_CHECK_PATH = "/v1/internal/key-check"


def env_int(env: Mapping[str, str], name: str, default: int) -> int:
    """The setting ``name`` from ``env``, an integer of at least 1 (``default`` when unset
    or empty); anything else stops the command with a message naming it."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not an integer") from None
    if value < 1:
        raise SystemExit(f"{name}={raw!r} must be at least 1")
    return value


@dataclass(frozen=True)
class ProxyConfig:
    """Where nginx listens, where daphne is, and the door's limits."""

    listen: str  # "127.0.0.1:8000", "0.0.0.0:8000", "[::1]:8000"
    upstream: str  # "unix:/path/web.sock" or "host:port"; several: comma-separated
    workdir: Path  # nginx's pid, logs and temporary bodies
    max_body_bytes: int = DATA_UPLOAD_MAX_MEMORY_SIZE
    header_timeout_s: int = PROXY_HEADER_TIMEOUT_S
    body_timeout_s: int = PROXY_BODY_TIMEOUT_S
    keepalive_s: int = PROXY_KEEPALIVE_S
    send_timeout_s: int = PROXY_SEND_TIMEOUT_S
    conns_per_address: int = PROXY_CONNS_PER_ADDRESS
    requests_per_s: int = PROXY_REQUESTS_PER_S
    request_burst: int = PROXY_REQUEST_BURST
    workers: int = PROXY_WORKERS
    # addresses of proxies in front of this one whose X-Forwarded-For is believed
    trusted: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_env(cls, listen: str, upstream: str, workdir: Path,
                 env: dict[str, str] | None = None) -> ProxyConfig:
        env = dict(os.environ if env is None else env)
        trusted = tuple(a.strip() for a in env.get("PROXY_TRUSTED_ADDRESSES", "").split(",")
                        if a.strip())
        return cls(
            listen=listen, upstream=upstream, workdir=Path(workdir),
            max_body_bytes=env_int(env, "DATA_UPLOAD_MAX_MEMORY_SIZE",
                                   DATA_UPLOAD_MAX_MEMORY_SIZE),
            header_timeout_s=env_int(env, "PROXY_HEADER_TIMEOUT_S", PROXY_HEADER_TIMEOUT_S),
            body_timeout_s=env_int(env, "PROXY_BODY_TIMEOUT_S", PROXY_BODY_TIMEOUT_S),
            keepalive_s=env_int(env, "PROXY_KEEPALIVE_S", PROXY_KEEPALIVE_S),
            send_timeout_s=env_int(env, "PROXY_SEND_TIMEOUT_S", PROXY_SEND_TIMEOUT_S),
            conns_per_address=env_int(env, "PROXY_CONNS_PER_ADDRESS",
                                      PROXY_CONNS_PER_ADDRESS),
            requests_per_s=env_int(env, "PROXY_REQUESTS_PER_S", PROXY_REQUESTS_PER_S),
            request_burst=env_int(env, "PROXY_REQUEST_BURST", PROXY_REQUEST_BURST),
            workers=env_int(env, "PROXY_WORKERS", PROXY_WORKERS),
            trusted=trusted,
        )

    @property
    def conf_path(self) -> Path:
        return self.workdir / "nginx.conf"

    @property
    def error_log(self) -> Path:
        return self.workdir / "error.log"


def _quoted(text: str) -> str:
    """``text`` as an nginx double-quoted string (no variable in it)."""
    if "$" in text:
        raise ValueError(f"a '$' would be an nginx variable: {text!r}")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _error(code: str, message: str) -> tuple[int, str]:
    """(status, nginx string of the JSON body) of one refusal in the API's error shape."""
    if code not in errors.CODES:
        raise KeyError(f"{code} is not in wire/errors.py's table")
    status = errors.status_of(code)
    body = json.dumps(errors.error_body(message, errors.type_of(status), code),
                      separators=(",", ":"))
    return status, _quoted(body)


def _refusal(code: str, message: str, indent: str = "        ",
             shape: str = "openai") -> str:
    status, body = (_anthropic_error if shape == ANTHROPIC else _error)(code, message)
    return f"{indent}return {status} {body};"


# /v1/messages (Anthropic's Messages API) answers errors in Anthropic's shape, the door's too:
# {"type": "error", "error": {"type", "message", "code", "param"}} (inference/anthropic_format.py,
# whose error_type this table follows: tests/test_messages_request.py)
ANTHROPIC = "anthropic"
ANTHROPIC_PATHS = "/v1/messages"
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                   504: "timeout_error"}


def anthropic_type(status: int, code: str) -> str:
    """Anthropic's error type of one of the door's refusals."""
    if code == "request_too_large":
        return "request_too_large"
    return ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def _anthropic_error(code: str, message: str) -> tuple[int, str]:
    if code not in errors.CODES:
        raise KeyError(f"{code} is not in wire/errors.py's table")
    status = errors.status_of(code)
    if code == "request_too_large":
        status = 413  # nginx's own status for it (daphne's is 400)
    body = json.dumps({"type": "error", "error": {"type": anthropic_type(status, code),
                                                  "message": message, "code": code,
                                                  "param": None}},
                      separators=(",", ":"))
    return status, _quoted(body)


# nginx's own refusals, each an internal location answering in the API's shape.
NO_KEY = "You didn't provide an API key. Send it as 'Authorization: Bearer sk-...'."
ANTHROPIC_NO_KEY = ("You didn't provide an API key. Send it as 'x-api-key: sk-...' or "
                    "'Authorization: Bearer sk-...'.")
BAD_KEY = "Incorrect API key provided."
REFUSALS = {
    "too_large": ("request_too_large", "The request body is larger than this server "
                  "accepts ({limit} bytes)."),
    "timeout": ("request_timeout", "The request's head or body stopped arriving; the "
                "connection is closed."),
    "too_many": ("too_many_connections", "Too many requests in progress from this address "
                 "at once; wait for some to finish."),
    "unavailable": ("service_unavailable", "The web server is not answering; try again "
                    "shortly."),
    "bad_request": ("invalid_request_error", "Your request could not be read (its head is "
                    "malformed or too large)."),
    "not_allowed": ("method_not_allowed", "This HTTP method is not allowed here."),
    "too_fast": ("requests_per_second_exceeded", "Too many requests a second with this key "
                 "(or from this address without one); slow down."),
}
# limit_req's refusal, told apart from limit_conn's 429 (a status no client sees: @too_fast
# answers 429)
RATE_REFUSAL_STATUS = 430


# Where nginx's own refusals are answered: internal locations of their own, not named ones.
# A request whose path nginx cannot parse (a %00 in it) has no URI, and nginx cannot pass
# such a request to a named location (it answers 500); an error page with a URI of its own
# gives it one.
REFUSAL_PREFIX = "/_door_refusal/"


def _refusal_locations(cfg: ProxyConfig) -> str:
    blocks = []
    for name, (code, message) in REFUSALS.items():
        text = message.format(limit=cfg.max_body_bytes)
        retry = ('        add_header Retry-After 1 always;\n'
                 if name in ("too_many", "too_fast", "unavailable") else "")
        # /v1/messages gets the refusal in Anthropic's shape (also one made before a
        # location is chosen: TRACE's 405, a bad head). Told by the request line: $uri is
        # the refusal's own here, and a path nginx could not parse leaves $request_uri empty
        messages = (f'        if ($request ~ "^[^ ]+ (https?://[^/]*)?{ANTHROPIC_PATHS}") {{\n'
                    f"{_refusal(code, text, ' ' * 12, ANTHROPIC)}\n        }}\n")
        blocks.append(f"    location = {REFUSAL_PREFIX}{name} {{\n        internal;\n"
                      f"        default_type application/json;\n"
                      f"{retry}{messages}{_refusal(code, text)}\n    }}\n")
    return "".join(blocks) + _key_refused() + _key_refused(ANTHROPIC)


def _key_refused(shape: str = "openai") -> str:
    """The key check refused: 401 (no usable key) or 403 (this address is throttled), as
    ``@key_refused`` or, in Anthropic's shape, ``@anthropic_key_refused``."""
    error = _anthropic_error if shape == ANTHROPIC else _error
    throttled_status, throttled = error("auth_throttled", "Too many failed authentications "
                                        "from this address; try again later.")
    no_key = ANTHROPIC_NO_KEY if shape == ANTHROPIC else NO_KEY
    return (
        f"    location @{'anthropic_' if shape == ANTHROPIC else ''}key_refused {{\n"
        "        default_type application/json;\n"
        "        if ($key_refusal = auth_throttled) {\n"
        "            add_header Retry-After $key_retry_after always;\n"
        f"            return {throttled_status} {throttled};\n"
        "        }\n"
        "        if ($presented_key = \"\") {\n"
        f"{_refusal('invalid_api_key', no_key, ' ' * 12, shape)}\n"
        "        }\n"
        f"{_refusal('invalid_api_key', BAD_KEY, shape=shape)}\n"
        "    }\n")


# Request headers daphne gets (a location that sets any proxy_set_header of its own loses
# the server's, so the key check repeats these).
FORWARDED = "".join(f"        proxy_set_header {line};\n" for line in (
    "Host $http_host",
    "X-Forwarded-For $remote_addr",
    "X-Forwarded-Proto $forwarded_proto",
    "X-Forwarded-Port $server_port",
    'Daphne-Root-Path ""',
))
# nginx's own refusals in the API's shape (repeated where a location adds error pages).
ERROR_PAGES = "".join(f"        error_page {codes} = {REFUSAL_PREFIX}{name};\n"
                      for codes, name in (
    ("413", "too_large"),
    ("408", "timeout"),
    ("429", "too_many"),
    ("502 504", "unavailable"),
    ("400 411 414 494 501", "bad_request"),
    ("405", "not_allowed"),
    (str(RATE_REFUSAL_STATUS), "too_fast"),
))


def _indent(block: str) -> str:
    return "".join(f"    {line}\n" for line in block.splitlines())


def _proxied(stream: bool) -> str:
    """The directives of a location that passes requests on to daphne."""
    lines = [
        "proxy_pass http://web;",
        "proxy_http_version 1.1;",
        # a response (SSE above all) goes out as daphne writes it
        "proxy_buffering off;",
        "proxy_cache off;",
        f"proxy_read_timeout {STREAM_READ_TIMEOUT_S if stream else 300}s;",
    ]
    return "".join(f"        {line}\n" for line in lines)


def upstream_servers(upstream: str) -> str:
    """The ``server`` lines of the upstream block: ``upstream`` is one address or several,
    comma-separated (``unix:/path`` or ``host:port``; a host name stands for every address
    it resolves to when nginx starts)."""
    addresses = [a.strip() for a in upstream.split(",") if a.strip()]
    if not addresses:
        raise ValueError("no upstream address")
    for address in addresses:
        if not address.startswith("unix:") and ":" not in address:
            raise ValueError(f"upstream {address!r}: use unix:/path or host:port")
    return "".join(f"        server {address};\n" for address in addresses)


def render(cfg: ProxyConfig) -> str:
    """nginx.conf for ``cfg``."""
    work = cfg.workdir
    servers = upstream_servers(cfg.upstream)
    anonymous = "|".join(p.replace(".", r"\.") for p in ANONYMOUS_API)
    # Behind a proxy of the operator's (TLS there): its X-Forwarded-For names the client and
    # its X-Forwarded-Proto the scheme, believed from those addresses only.
    real_ip = "".join(f"    set_real_ip_from {a};\n" for a in cfg.trusted)
    if real_ip:
        real_ip += "    real_ip_header X-Forwarded-For;\n    real_ip_recursive on;\n"
    trusted = "".join(f"        {a} 1;\n" for a in cfg.trusted)
    real_ip += ("    geo $realip_remote_addr $from_trusted {\n        default 0;\n"
                f"{trusted}    }}\n"
                '    map "$from_trusted:$http_x_forwarded_proto" $forwarded_proto {\n'
                '        default $scheme;\n        "1:https" https;\n    }\n')
    # Started by root, nginx runs its workers as nobody, who could not open daphne's socket
    # (mode 600): they run as the user who runs daphne, as they do when nginx is not root.
    # past the rate, the first requests of a burst go at once, the rest wait their turn
    delay = min(cfg.requests_per_s, cfg.request_burst)
    anonymous_rate = (f"limit_req zone=anonymous_per_address burst={cfg.request_burst} "
                      f"delay={delay};")
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name};\n" if os.geteuid() == 0 else ""
    return f"""# Written by config/proxy.py; edit the settings (docs/security.md), not this file.
{user}worker_processes {cfg.workers};
pid {work / 'nginx.pid'};
error_log {cfg.error_log} warn;
events {{
    worker_connections {WORKER_CONNECTIONS};
}}
http {{
    access_log off;
    server_tokens off;
    default_type application/octet-stream;
    client_body_temp_path {work / 'body'};
    proxy_temp_path {work / 'proxy'};
    fastcgi_temp_path {work / 'fastcgi'};
    uwsgi_temp_path {work / 'uwsgi'};
    scgi_temp_path {work / 'scgi'};
    proxy_cache_path {work / 'throttled'} levels=1:2 keys_zone=throttled:1m max_size=16m
                     inactive=10m use_temp_path=off;

    # bodies: never past the limit, and only once the key is good (auth_request below)
    client_max_body_size {cfg.max_body_bytes};
    client_body_buffer_size 64k;
    # slow clients
    client_header_timeout {cfg.header_timeout_s}s;
    client_body_timeout {cfg.body_timeout_s}s;
    keepalive_timeout {cfg.keepalive_s}s;
    send_timeout {cfg.send_timeout_s}s;
    lingering_time {LINGERING_S}s;
    lingering_timeout {LINGERING_S}s;
    reset_timedout_connection on;
    client_header_buffer_size 4k;
    large_client_header_buffers 4 16k;
    # requests in progress per client address
    limit_conn_zone $binary_remote_addr zone=per_address:10m;
    limit_conn per_address {cfg.conns_per_address};
    limit_conn_status 429;
    limit_conn_log_level warn;
    # requests a second: per key on the keyed API (a request without one is refused by the
    # key check; a wrong key's by the throttle), per address on the anonymous API
    limit_req_zone $rate_key zone=per_key:10m rate={cfg.requests_per_s}r/s;
    limit_req_zone $binary_remote_addr zone=anonymous_per_address:10m rate={cfg.requests_per_s}r/s;
    limit_req_status {RATE_REFUSAL_STATUS};
    limit_req_log_level warn;
{real_ip}
    map $http_upgrade $connection_upgrade {{
        default upgrade;
        "" "";
    }}
    # what the key check looked at (an API key in either header)
    map $http_authorization$http_x_api_key $presented_key {{
        default $http_authorization$http_x_api_key;
    }}
    # the key a request's rate is counted under: the key check's (Authorization when sent,
    # else X-Api-Key), its first run of printable characters, so that one key spelled with
    # other spaces or a case of "Bearer" of its own is still one key
    map $http_authorization $authorization_token {{
        "~*^\\s*bearer\\s+(?<token>[!-~]{{1,128}})" $token;
        default "";
    }}
    map $http_x_api_key $api_key_token {{
        "~^\\s*(?<token>[!-~]{{1,128}})" $token;
        default "";
    }}
    map $http_authorization $rate_key {{
        "" $api_key_token;
        default $authorization_token;
    }}

    # the web processes (WEB_WORKERS, config/web_procs.py; compose's replicas): each request
    # to the one with the fewest in progress, so a burst and long-lived streams spread
    upstream web {{
        least_conn;
{servers}        keepalive 64;
    }}

    server {{
        listen {cfg.listen} backlog=1024;
        # what daphne hears about the client: set here, never appended to
{FORWARDED}        proxy_set_header Connection $connection_upgrade;
        proxy_set_header Upgrade $http_upgrade;
{ERROR_PAGES}
        # the key check: headers only, answered by Django (204, 401 or 403)
        location = /_key_check {{
            internal;
            proxy_pass http://web{KEY_CHECK_PATH};
            # a flooding address's 403 (X-Accel-Expires: its Retry-After) is kept per
            # address; nothing else is cached (no other answer says how long it holds)
            proxy_cache throttled;
            proxy_cache_key $remote_addr;
            proxy_cache_methods GET HEAD;
            proxy_http_version 1.1;
            proxy_pass_request_body off;
{_indent(FORWARDED)}            proxy_set_header Content-Length "";
            proxy_set_header Transfer-Encoding "";
            proxy_set_header Expect "";
            proxy_set_header Connection "";
            proxy_set_header Upgrade "";
            proxy_set_header X-Original-Method $request_method;
            proxy_set_header X-Original-URI $request_uri;
        }}
        # never reached from outside
        location /v1/internal/ {{
            default_type application/json;
{_refusal("not_found", "Not found.", " " * 12)}
        }}
        # the API without a key: health, the schema, the docs, metrics (its own check)
        location ~ ^/v1/({anonymous})$ {{
            {anonymous_rate}
{_proxied(False)}        }}
        location = /metrics {{
            {anonymous_rate}
{_proxied(False)}        }}
        # the API: the key first, then the body
        location /v1/ {{
            limit_req zone=per_key burst={cfg.request_burst} delay={delay};
            auth_request /_key_check;
            auth_request_set $key_refusal $upstream_http_x_refusal;
            auth_request_set $key_retry_after $upstream_http_retry_after;
            # (error_page here replaces the server's: all of them again)
{_indent(ERROR_PAGES)}            error_page 401 403 = @key_refused;
{_proxied(True)}        }}
        # Anthropic's Messages API: the same, its key refused in Anthropic's shape (the
        # refusal locations answer it in that shape too)
        location {ANTHROPIC_PATHS} {{
            limit_req zone=per_key burst={cfg.request_burst} delay={delay};
            auth_request /_key_check;
            auth_request_set $key_refusal $upstream_http_x_refusal;
            auth_request_set $key_retry_after $upstream_http_retry_after;
{_indent(ERROR_PAGES)}            error_page 401 403 = @anthropic_key_refused;
{_proxied(True)}        }}
        # websockets: the key is checked by the consumer (header or first message)
        location /ws/ {{
{_proxied(True)}        }}
        # the site: admin, playground, static files
        location / {{
{_proxied(False)}        }}
{_refusal_locations(cfg)}    }}
}}
"""


def write(cfg: ProxyConfig) -> Path:
    """Write nginx.conf (and nginx's directories) under ``cfg.workdir``; its path."""
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (cfg.workdir / sub).mkdir(mode=0o700, exist_ok=True)
    cfg.conf_path.write_text(render(cfg))
    return cfg.conf_path


def nginx_binary() -> str | None:
    """nginx's path (Debian puts it in /usr/sbin, off a plain user's PATH), or None."""
    found = shutil.which("nginx")
    if found:
        return found
    return next((p for p in NGINX_PATHS if os.access(p, os.X_OK)), None)


def nginx_argv(cfg: ProxyConfig) -> list[str]:
    """nginx in the foreground on ``cfg``'s configuration (call ``write`` first)."""
    binary = nginx_binary()
    if binary is None:
        raise FileNotFoundError("nginx is not installed (Debian: apt-get install nginx-light)")
    return [binary, "-p", str(cfg.workdir), "-e", str(cfg.error_log), "-c", str(cfg.conf_path),
            "-g", "daemon off;"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the door's nginx.conf and run nginx.")
    parser.add_argument("--listen", default="0.0.0.0:8000")
    parser.add_argument("--upstream", default="web:8000")
    parser.add_argument("--workdir", default="/tmp/llm-proxy")
    parser.add_argument("--print", action="store_true", help="print the configuration only")
    args = parser.parse_args(argv)
    cfg = ProxyConfig.from_env(args.listen, args.upstream, Path(args.workdir))
    if args.print:
        print(render(cfg), end="")
        return
    write(cfg)
    command = nginx_argv(cfg)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
