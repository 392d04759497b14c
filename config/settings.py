"""Settings, all read from the environment (see docs/running.md for the full table).

Defaults: DEBUG off (the dev launcher, `make run`, turns it on), SQLite in the project
folder, Redis on localhost.
"""

import os
from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from config import proxy, web_procs
from config.env import (
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_list,
    env_str,
    local_secret_key,
)
from config.models import DEFAULT_MODELS
from config.models import default_path as default_model_path

BASE_DIR = Path(__file__).resolve().parent.parent

# Off unless set: debug pages show settings and tracebacks. scripts/dev.py (make run/test)
# sets DEBUG=true for a laptop; tests/settings.py does for pytest.
DEBUG = env_bool("DEBUG", False)

SECRET_KEY = env_str("SECRET_KEY")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured(
            "SECRET_KEY must be set when DEBUG is off "
            "(e.g. SECRET_KEY=$(python -c 'import secrets; print(secrets.token_urlsafe(50))')); "
            "on a laptop, `make run` (or DEBUG=true) uses a generated .secret_key"
        )
    SECRET_KEY = local_secret_key(BASE_DIR / ".secret_key")

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"] if DEBUG else [])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])
# The URL prefix the service is mounted under (Django's script name), e.g. "/llm" behind a
# proxy that forwards /llm/... unchanged. daphne takes a client's `Daphne-Root-Path` header
# as the root path (over its --root-path), so config/asgi.py replaces the scope's root path
# with this one, unless a proxy in front sets that header on every request and strips
# clients' (then TRUST_ROOT_PATH_HEADER=true).
ROOT_PATH = env_str("ROOT_PATH", "")
TRUST_ROOT_PATH_HEADER = env_bool("TRUST_ROOT_PATH_HEADER", False)

# HTTPS (docs/security.md): on by default when DEBUG is off, where a proxy in front
# terminates TLS and says so in X-Forwarded-Proto (which it sets on every request). On:
# cookies only over HTTPS, HSTS, plain HTTP redirected, but for what machines reach
# directly (the proxy's key check, metrics scrapes, health probes). Each can be set on its
# own; HTTPS_ONLY=false turns them all off for a set-up served over plain HTTP (compose on
# localhost).
HTTPS_ONLY = env_bool("HTTPS_ONLY", not DEBUG)
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_X_FORWARDED_PROTO", "https") if env_bool("TRUST_FORWARDED_PROTO", True) else None)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", HTTPS_ONLY)
# (matched against the path with ROOT_PATH, without its first "/")
SECURE_REDIRECT_EXEMPT = [r"(^|/)internal/key-check$", r"(^|/)(v1/)?metrics$", r"(^|/)v1/health$"]
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", HTTPS_ONLY)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", HTTPS_ONLY)
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SAMESITE = "Lax"
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 365 * 24 * 3600 if HTTPS_ONLY else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "adrf",
    "drf_spectacular",
    "channels",
    "axes",
    "accounts",
    "inference",
    "console",
    "scheduler_daemon",
]

# The key-authenticated API's URL prefix (inference/urls.py mounts it; the middleware and
# the error pages look requests up by it).
API_PREFIX = "/v1/"
# Django's default middleware, which the site (admin, playground) runs. The API has no use
# for sessions, CSRF, users or messages: config/middleware.py, the one entry of MIDDLEWARE,
# runs SITE_MIDDLEWARE outside API_PREFIX and only API_MIDDLEWARE's hooks (on the event
# loop: they do no I/O) under it.
SITE_MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # last, as django-axes asks: turns a locked-out login into its refusal page
    "axes.middleware.AxesMiddleware",
]
API_MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
MIDDLEWARE = ["config.middleware.SiteOrApiMiddleware"]
# The admin's, django-axes' and Django's security checks look for their middleware in
# MIDDLEWARE; it is in SITE_MIDDLEWARE (tests/test_settings.py runs Django's deploy checks
# with MIDDLEWARE = SITE_MIDDLEWARE). W021: HSTS preload commits the whole domain to the
# browsers' lists; an operator opts in (SECURE_HSTS_PRELOAD=true).
SILENCED_SYSTEM_CHECKS = [
    "admin.E408", "admin.E409", "admin.E410", "axes.W002",
    "security.W001", "security.W002", "security.W003", "security.W021",
]

ROOT_URLCONF = "config.urls"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        env_str("DATABASE_URL", f"sqlite:///{BASE_DIR / 'db.sqlite3'}"),
        conn_health_checks=True,
    ),
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The web and the scheduler daemon write history from two processes: WAL lets readers
    # and a writer overlap, and a writer waits for the lock instead of failing at once.
    # synchronous=NORMAL: with WAL, commits skip the fsync (a power cut may lose the last
    # history rows, never corrupt the file): that fsync sat on every request's path.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"timeout": 20, "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"}
    )
    # Long-lived threads keep their connection (the web's database thread, inference/db.py;
    # the daemon's history writer): a new one costs ~0.5 ms of CPU. Under ASGI a request's
    # own thread ends with the request, and its connection with it.
    DATABASES["default"]["CONN_MAX_AGE"] = env_int("CONN_MAX_AGE", 600)
elif DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # Django's connection pool (psycopg_pool): every thread, a request's or a long-lived
    # one, borrows a connection and gives it back (CONN_MAX_AGE must stay 0 with a pool).
    # DATABASE_POOL=false: a connection per request thread, kept by the long-lived ones.
    if env_bool("DATABASE_POOL", True):
        DATABASES["default"].setdefault("OPTIONS", {})["pool"] = True
    else:
        DATABASES["default"]["CONN_MAX_AGE"] = env_int("CONN_MAX_AGE", 600)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Admin logins (django-axes, docs/security.md): after AXES_FAILURE_LIMIT wrong passwords
# from one client address (REMOTE_ADDR: the proxy's X-Forwarded-For, through daphne's
# --proxy-headers), that address's logins are refused, the right password too, until
# AXES_COOLOFF_MINUTES pass without another try (429, a plain page). By address, not by
# user name: a guesser can neither lock the administrator out from elsewhere nor spread
# guesses over user names; a success does not clear the count (a known low-privilege login
# cannot buy more guesses).
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env_int("AXES_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = timedelta(minutes=env_float("AXES_COOLOFF_MINUTES", 15.0))
AXES_LOCKOUT_PARAMETERS = ["ip_address"]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
# daphne serves /static/ itself (admin CSS); turn off behind a web server that does.
SERVE_STATIC = env_bool("SERVE_STATIC", True)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["inference.auth.ApiKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "inference.negotiation.JsonAlways",
    "EXCEPTION_HANDLER": "inference.errors.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "LLM inference service API",
    "DESCRIPTION": "OpenAI-compatible completions, chat completions and responses, "
    "Anthropic-compatible messages, request history, usage. Errors use OpenAI's shape: "
    "{\"error\": {message, type, param, code}}; /v1/messages answers Anthropic's "
    "{\"type\": \"error\", \"error\": {type, message}} (with param and code besides).",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # chat's and the Responses API's tools both have a "type": "function"
    "ENUM_NAME_OVERRIDES": {"FunctionToolTypeEnum": ["function"]},
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums"],
}

# Request bodies (the API answers 400 request_too_large past it): Django's default, 2.5 MB;
# the door (nginx, config/proxy.py) reads no body past it either.
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("DATA_UPLOAD_MAX_MEMORY_SIZE",
                                      proxy.DATA_UPLOAD_MAX_MEMORY_SIZE)

# Redis: job queue and token pipe between web and the scheduler daemon.
REDIS_URL = env_str("REDIS_URL", "redis://127.0.0.1:6379/0")
# The web's database calls from async code, and the API's key lookups, run on one thread
# that keeps its connection (inference/db.py). Not an environment setting: in-process
# tests turn it off.
WEB_DB_THREAD = True
# The web's waits: for a daemon to take a queued job, and for a whole request.
ACCEPT_TIMEOUT_S = env_float("ACCEPT_TIMEOUT_S", 30.0)
REQUEST_TIMEOUT_S = env_float("REQUEST_TIMEOUT_S", 600.0)
# Nothing lost (docs/faults.md): a request's events stay this long after its last event; a
# request whose daemon died waits this long for another to continue it; a request whose
# reader went away runs on this long for a client to resume it.
STREAM_RETENTION_S = env_int("STREAM_RETENTION_S", 600)
RECOVERY_TIMEOUT_S = env_float("RECOVERY_TIMEOUT_S", 60.0)
RESUME_GRACE_S = env_float("RESUME_GRACE_S", 10.0)
# Sessions that continue (wire/sessions.py): a client sends only its new turn
# ("continue": true) and the service holds the conversation's tokens this long after its
# last turn; a tenant holds at most SESSIONS_PER_TENANT of them (docs/api.md, "Sessions").
SESSION_TTL_S = env_int("SESSION_TTL_S", 3600)
SESSIONS_PER_TENANT = env_int("SESSIONS_PER_TENANT", 1000)
# Each web process's Redis (inference/broker.py): the pool's size (its stream reader has a
# connection of its own), how many streams/resumes may be read at once (past it: 503
# service_unavailable), how long a command waits for a connection.
WEB_REDIS_MAX_CONNECTIONS = env_int("WEB_REDIS_MAX_CONNECTIONS", 128)
WEB_MAX_STREAMS = env_int("WEB_MAX_STREAMS", 512)
# A tenant's share of those readers (0: a quarter of WEB_MAX_STREAMS) and the readers one
# request may have at once (its stream and resumes); past either: 429 too_many_streams.
WEB_TENANT_STREAMS = env_int("WEB_TENANT_STREAMS", 0)
WEB_READERS_PER_REQUEST = env_int("WEB_READERS_PER_REQUEST", 4)
# Replays of finished requests per tenant per minute (0: unlimited); past it: 429
# replays_exceeded. A replay also counts against the tenant's requests per minute.
REPLAYS_PER_MINUTE = env_int("REPLAYS_PER_MINUTE", 60)
WEB_REDIS_POOL_TIMEOUT_S = env_float("WEB_REDIS_POOL_TIMEOUT_S", 5.0)
# How many web processes (daphne) make run and compose's web container start behind one
# port (config/web_procs.py, docs/running.md): the cores, at most 4. Read there before
# Django; here so that a bad value fails the same way everywhere.
WEB_WORKERS = env_int("WEB_WORKERS", web_procs.default_workers())
if WEB_WORKERS < 1:
    raise ImproperlyConfigured(f"WEB_WORKERS={WEB_WORKERS} must be at least 1")
# Websockets (inference/consumers.py): authenticate within this long or the socket closes
# (4401); open sockets' keys are checked again this often (revoked key: close 4401).
WS_AUTH_TIMEOUT_S = env_float("WS_AUTH_TIMEOUT_S", 10.0)
WS_REVOCATION_CHECK_S = env_float("WS_REVOCATION_CHECK_S", 1.0)
# SSE: a comment line after this many seconds without an event, so that proxies keep an idle
# stream open (inference/api_views.py).
SSE_KEEPALIVE_S = env_float("SSE_KEEPALIVE_S", 15.0)

# Tenant limits (docs/limits.md): a request holds its concurrency slot at most
# ACCEPT_TIMEOUT_S + REQUEST_TIMEOUT_S + this, so a crash never leaks one for good.
LIMIT_SLOT_GRACE_S = env_float("LIMIT_SLOT_GRACE_S", 60.0)
# /metrics (docs/observability.md): a Bearer token; empty: only clients in these networks.
METRICS_TOKEN = env_str("METRICS_TOKEN", "")
METRICS_ALLOWED_NETS = env_list("METRICS_ALLOWED_NETS", ["127.0.0.1/32", "::1/128"])
# Wrong API keys (inference/auth.py): a key prefix no key has is answered without a query
# for this long; a client address with this many failed key checks in a minute is refused
# (429 auth_throttled) for the rest of that minute, without a query. 0: off.
AUTH_NEGATIVE_CACHE_S = env_float("AUTH_NEGATIVE_CACHE_S", 30.0)
AUTH_FAILURES_PER_MINUTE = env_int("AUTH_FAILURES_PER_MINUTE", 30)

# The model and the scheduler daemon's knobs.
# The models `make run` serves, one daemon each (config/models.py's catalog names them);
# the first is the default: a request that names no model, the playground, the README.
MODELS = env_list("MODELS", DEFAULT_MODELS) or DEFAULT_MODELS
# A daemon serves MODEL_NAME (default: the first of MODELS) from MODEL_PATH (default: the
# catalog's file for that name; Gemma's for a name outside the catalog).
MODEL_NAME = env_str("MODEL_NAME", MODELS[0])
MODEL_PATH = env_str("MODEL_PATH", default_model_path(MODEL_NAME))
CHAT_TEMPLATE = env_str("CHAT_TEMPLATE", "")  # empty: the GGUF's own template
N_PARALLEL = env_int("N_PARALLEL", 4)
N_CTX = env_int("N_CTX", 8192)
# A prompt's text (a completion's prompt, or all chat message contents) in UTF-8 bytes,
# refused before anything tokenizes it (web and daemon both check). Default: 32 bytes per
# token of context, 256 KiB at N_CTX 8192. Gemma's longest token is 31 bytes (a run of
# spaces), so no prompt that fits the context is refused for its bytes; ordinary text runs
# 3-6 bytes per token (English ~3.2, CJK ~6), so 256 KiB is ~10x what fits. Tokenizing
# grows faster than linearly: 32 KiB ~0.08 s, 256 KiB ~0.7-1.1 s, 512 KiB ~4 s (one
# core of the shared 2-core dev machine, under load): the cap bounds that cost.
MAX_PROMPT_BYTES = env_int("MAX_PROMPT_BYTES", 32 * N_CTX)
# A /v1/tokenize or /v1/detokenize answer's JSON in bytes (the daemon refuses a longer one
# with a 400 naming the field; with_pieces from its token count before any piece is built).
# 1 MiB: ~40,000 tokens with pieces (5x the default context), any context's ids without.
MAX_VOCAB_ANSWER_BYTES = env_int("MAX_VOCAB_ANSWER_BYTES", 2**20)
# (daemon) Tokenize/detokenize jobs in flight in a daemon (queued for its vocabulary thread
# or being answered, one at a time): one tenant's past VOCAB_TENANT_JOBS are refused 429
# tenant_queue_full, all tenants' past VOCAB_JOBS 503 queue_full. They do not take the room
# kept for generation (N_PARALLEL + LOCAL_QUEUE). docs/api.md.
VOCAB_TENANT_JOBS = env_int("VOCAB_TENANT_JOBS", 4)
VOCAB_JOBS = env_int("VOCAB_JOBS", 16)
N_BATCH = env_int("N_BATCH", min(N_CTX, 2048))
CHUNK_SIZE = env_int("CHUNK_SIZE", 512)
# (daemon) Prompts whose prefill may finish in one tick (0: as many as fit). 1 on a CPU, whose
# prefill costs the same per token batched or not: a burst's first tokens come one prompt's
# prefill apart instead of all after the whole burst's. 0 on a GPU. docs/scheduler.md.
PREFILL_PROMPTS_PER_TICK = env_int("PREFILL_PROMPTS_PER_TICK", 1)
# max_tokens of a request that names none (bounded by the context either way)
DEFAULT_MAX_TOKENS = env_int("DEFAULT_MAX_TOKENS", 512)
# Jobs waiting for the model that each live daemon adds to the web's limit (past it: 503
# queue_full, decided by the web from the queue in Redis: wire/queue.py). A daemon holds
# at most N_PARALLEL + LOCAL_QUEUE jobs (running and locally queued); the rest wait in
# Redis, where any daemon of the model can take them.
MAX_QUEUE = env_int("MAX_QUEUE", 64)
LOCAL_QUEUE = env_int("LOCAL_QUEUE", N_PARALLEL)
# Routing in a fleet of daemons of one model (docs/fleet.md): cache_aware (a session's
# daemon, else the longest match of the prompt's salted prefix hashes, unless that daemon is
# busier than the least loaded by more than ROUTE_BALANCE_ABS jobs *and* ROUTE_BALANCE_REL
# times), round_robin, or shared (whoever has room takes each job).
ROUTING = env_choice("ROUTING", "cache_aware", ("cache_aware", "round_robin", "shared"))
ROUTE_BALANCE_ABS = env_float("ROUTE_BALANCE_ABS", 4.0)
ROUTE_BALANCE_REL = env_float("ROUTE_BALANCE_REL", 1.5)
# Fair shares (docs/security.md): waiting jobs one tenant may hold in a daemon's queue (a
# tenant's own `max_queued` wins), and the most of the KV budget one tenant's running
# requests may reserve (also the most one request may ask for: prompt + max_tokens).
MAX_QUEUE_PER_TENANT = env_int("MAX_QUEUE_PER_TENANT", max(1, MAX_QUEUE // 2))
KV_TENANT_SHARE = env_float("KV_TENANT_SHARE", 0.5)
# (daemon) While another tenant's request waits for a slot, a tenant holding at least two
# slots more than that tenant gives up one generating sequence (its KV saved to the RAM
# prompt cache, else recomputed at its resume), once that sequence has generated
# PREEMPT_MIN_TOKENS since it got its slot. docs/scheduler.md, "Preemption".
PREEMPTION = env_bool("PREEMPTION", True)
PREEMPT_MIN_TOKENS = env_int("PREEMPT_MIN_TOKENS", 16)
# Test-only: a job whose prompt holds run_scheduler.FAULT_MARKER aborts the daemon
# process, one holding run_scheduler.HANG_MARKER stops its loop for good (to test the
# supervisor, its watchdog and the quarantine). Never on in production.
FAULT_INJECTION = env_bool("FAULT_INJECTION", False)
# A hang is a crash: the supervisor kills a daemon whose loop has not completed a turn (a
# tick, an embeddings batch) for this long, and restarts it (docs/daemon.md). 0: never. The
# longest legitimate turn measured is 21.5 s (SmolLM2, N_BATCH of prefill at 8k context on 2
# loaded cores: bench/results/tick_deadline-2026-12-05.txt); a false kill costs every running
# request a death, so the margin is wide.
TICK_DEADLINE_S = env_float("TICK_DEADLINE_S", 120.0)
# One request's sampler call (its grammar over the vocabulary) gets a deadline of its own:
# priced grammars cost at most ~0.25 s per token on 2 cores (wire/grammar_cost.py), so a call
# this long is a grammar the pricing missed; its request alone is blamed. 0: never.
SAMPLER_DEADLINE_S = env_float("SAMPLER_DEADLINE_S", 10.0)
# A request that was streaming when its daemon died is continued by the daemon that takes
# it over (its tokens replayed, docs/daemon.md); off: it ends with inference_interrupted.
CONTINUE_STREAMS = env_bool("CONTINUE_STREAMS", True)
N_THREADS = env_int("N_THREADS", os.cpu_count() or 1)
# (daemon) The model's layers whose weights llama.cpp puts on the GPU: 0 none (the default:
# the CPU build has no GPU), -1 (or any number past the model's layers, e.g. 999) all. Needs a
# CUDA build (LLAMA_CUDA=1 make setup, docs/running.md "GPU"); a CPU build ignores it.
N_GPU_LAYERS = env_int("N_GPU_LAYERS", 0)
KV_BLOCK_TOKENS = env_int("KV_BLOCK_TOKENS", 256)
CACHE_PROMPT = env_bool("CACHE_PROMPT", True)
PROMPT_CACHE_RAM_MB = env_int("PROMPT_CACHE_RAM_MB", 256)
# (daemon) An admission moves the other idle slots' prefixes to the RAM tier and frees their
# cells, so that its prefill attends over the running slots only (llama-server's
# cache_idle_slots); returning sessions then restore from RAM. docs/performance.md.
IDLE_SLOTS_TO_RAM = env_bool("IDLE_SLOTS_TO_RAM", True)
PROMPT_CACHE_TENANT_SHARE = env_float("PROMPT_CACHE_TENANT_SHARE", 0.5)
# (daemon) The prompt cache's disk tier: sequence states as files under PROMPT_CACHE_DIR (a
# folder per model and context layout, one per tenant inside it; mode 0700), at most
# PROMPT_CACHE_DISK_MB (LRU), so that a conversation's next turn after a restart is a hit.
# States of at least PROMPT_CACHE_DISK_MIN_TOKENS go there when a request ends, when the RAM
# tier pushes them out and at shutdown (for at most PROMPT_CACHE_SHUTDOWN_S). 0 MB: off.
PROMPT_CACHE_DIR = env_str("PROMPT_CACHE_DIR", str(BASE_DIR / "var" / "prompt-cache"))
PROMPT_CACHE_DISK_MB = env_int("PROMPT_CACHE_DISK_MB", 2048)
PROMPT_CACHE_DISK_MIN_TOKENS = env_int("PROMPT_CACHE_DISK_MIN_TOKENS", 256)
PROMPT_CACHE_SHUTDOWN_S = env_float("PROMPT_CACHE_SHUTDOWN_S", 5.0)
# Tenants' LoRA adapters (docs/adapters.md): every registered file lies inside ADAPTERS_DIR
# (checked when it is registered); the web and the daemons must see it at the same path.
ADAPTERS_DIR = env_str("ADAPTERS_DIR", str(BASE_DIR / "var" / "adapters"))
# (daemon) LoRA adapters a daemon holds loaded at once (the least recently used one no
# request holds is unloaded for a new one; all in use: 503 adapters_busy). docs/scheduler.md.
MAX_LOADED_ADAPTERS = env_int("MAX_LOADED_ADAPTERS", 8)
# A stream's later tokens are written to Redis at most this often (several per event); its
# first token and its end go at once. 0: every tick. See docs/daemon.md.
STREAM_INTERVAL_MS = env_int("STREAM_INTERVAL_MS", 50)
# The daemon serves /v1/embeddings for its model (a second llama.cpp context, made at the
# first embeddings request: mean pooling, normalized; docs/api.md).
EMBEDDINGS = env_bool("EMBEDDINGS", True)
# (daemon) Embeddings tokens one tenant's jobs may hold in a daemon (waiting or running, not
# yet embedded); a job past it is refused 429 tenant_queue_full (docs/api.md).
EMBEDDINGS_TENANT_TOKENS = env_int("EMBEDDINGS_TENANT_TOKENS", 65_536)

# (daemon, benchmarks only) ENGINE_STANDIN names a stand-in for llama.cpp ("module:factory",
# e.g. tests.standin_engine:make_engine): no model is loaded and every decode call returns
# when the next of ENGINE_STANDIN_RATE ticks a second is due (bench/web_capacity.py). Empty,
# the default: the real engine.
ENGINE_STANDIN = env_str("ENGINE_STANDIN", "")
ENGINE_STANDIN_RATE = env_float("ENGINE_STANDIN_RATE", 20.0)

# (daemon) Its telemetry (JSON lines on stderr, docs/observability.md) has at most one
# `tick` line per this many seconds; 0: every tick.
TELEMETRY_TICK_S = env_float("TELEMETRY_TICK_S", 1.0)
LOG_LEVEL = env_str("LOG_LEVEL", "INFO").upper()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "plain"},
    },
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    # Replace Django's own console handler, which would print each record a second time.
    "loggers": {"django": {"handlers": [], "level": LOG_LEVEL, "propagate": True}},
}

# /v1/responses: a response made with store (the default) is kept this many days for GET
# /v1/responses/<id> and previous_response_id, then deleted (docs/api.md, Responses).
RESPONSES_RETENTION_DAYS = env_int("RESPONSES_RETENTION_DAYS", 30)

# The tenant console (docs/console.md). An invite is Django's password-reset email (its link
# sets the first password, valid PASSWORD_RESET_TIMEOUT_S; a reset's link is the same); the
# console backend prints mails on the web's (or the command's) stdout unless EMAIL_BACKEND
# names another, e.g. django.core.mail.backends.smtp.EmailBackend with the EMAIL_* below.
# CONSOLE_URL: where members reach the service, for the links `manage.py invite` mails
# (the admin's invites link to the address the operator used).
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "console@localhost")
PASSWORD_RESET_TIMEOUT = env_int("PASSWORD_RESET_TIMEOUT_S", 3 * 24 * 3600)
CONSOLE_URL = env_str("CONSOLE_URL", "http://127.0.0.1:8000").rstrip("/")
LOGIN_URL = "console:login"
LOGIN_REDIRECT_URL = "console:keys"
# rows per page of the console's requests and audit log
CONSOLE_PAGE_SIZE = env_int("CONSOLE_PAGE_SIZE", 50)

# (daemon; the web reads the retention) The operator's overview's time series
# (docs/observability.md, "The operator's overview"): each daemon writes a sample into Redis
# every TIMESERIES_INTERVAL_S (0: none), kept TIMESERIES_RETENTION_S (the overview's ranges
# end there).
TIMESERIES_INTERVAL_S = env_float("TIMESERIES_INTERVAL_S", 10.0)
TIMESERIES_RETENTION_S = env_int("TIMESERIES_RETENTION_S", 7 * 86400)
