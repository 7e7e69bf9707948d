"""Relay settings. Every value comes from the environment (django-environ).

Two modes share this file:
- embedded (`make run`): SQLite + an embedded redis-server started by
  `relay.embedded`; secrets are generated once and kept under `.relay-embedded/`.
- full stack / production: `DATABASE_URL`, `REDIS_URL` and the secrets are set
  explicitly. Outside DEBUG and embedded mode a missing secret stops start-up
  with a message that names it.

`.env.example` lists every variable.
"""

import tempfile
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from batches import queues

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
# A local .env is a convenience for developers; the environment always wins.
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

DEBUG = env.bool("DEBUG", default=False)
RELAY_EMBEDDED = env.bool("RELAY_EMBEDDED", default=False)


def _secret(name: str) -> str:
    value = env.str(name, default="")
    if value:
        return value
    if DEBUG or RELAY_EMBEDDED:
        # Development only: a fixed, clearly insecure value so tests and a
        # throw-away checkout run without ceremony.
        return f"insecure-dev-{name.lower()}"
    raise ImproperlyConfigured(
        f"{name} is not set. Set it in the environment (see .env.example); "
        "only DEBUG=1 or RELAY_EMBEDDED=1 may run without it."
    )


SECRET_KEY = _secret("SECRET_KEY")
RELAY_MASTER_KEY = _secret("RELAY_MASTER_KEY")
RELAY_ADMIN_TOKEN = _secret("RELAY_ADMIN_TOKEN")
# A host key's `value_from: {env: NAME}` is read only when NAME starts with this (core.models.HostKey): the
# process that calls providers also holds the secrets above, the database URL and cloud credentials.
RELAY_HOSTKEY_ENV_PREFIX = env.str("RELAY_HOSTKEY_ENV_PREFIX", default="RELAY_HOSTKEY_")
if not RELAY_HOSTKEY_ENV_PREFIX:
    raise ImproperlyConfigured("RELAY_HOSTKEY_ENV_PREFIX must not be empty: it keeps host keys off other variables")

ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["*"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "core",
    "usage",
    "policies",
    "gateway",
    "batches",
    "batches.webhooks",
    "relay",
]

MIDDLEWARE = [
    # First: request id, URL/query/Content-Length/chunked checks, JSON errors (decision 0008).
    "gateway.edge.EdgeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    # Django's own four below, skipped on the live inference routes (they authenticate a relay key
    # or token only; gateway.edge).
    "gateway.edge.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "gateway.edge.CsrfViewMiddleware",
    "gateway.edge.AuthenticationMiddleware",
    "gateway.edge.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "relay.urls"
WSGI_APPLICATION = "relay.wsgi.application"
AUTH_USER_MODEL = "relay.User"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # First: relay/templates/admin/base_site.html (the admin pages' shared style) over the admin app's own.
        "DIRS": [BASE_DIR / "relay" / "templates"],
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

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{BASE_DIR / '.relay-embedded' / 'relay.sqlite3'}")}
DATABASES["default"].setdefault("CONN_MAX_AGE", env.int("DB_CONN_MAX_AGE", default=60))
# A `SELECT 1` before the first query of each request and each batch item, so a connection broken
# while idle (PostgreSQL restarted) is replaced instead of failing that request. On PostgreSQL it is
# skipped for a connection that answered a statement less than RELAY_DB_HEALTH_CHECK_IDLE_S ago
# (core/db/postgresql: a busy process pays no round trip for it); DB_CONN_HEALTH_CHECKS=0 turns it off.
DATABASES["default"]["CONN_HEALTH_CHECKS"] = env.bool("DB_CONN_HEALTH_CHECKS", default=True)
RELAY_DB_HEALTH_CHECK_IDLE_S = env.float("RELAY_DB_HEALTH_CHECK_IDLE_S", default=1.0)
# No statement runs longer (PostgreSQL); a native batch streamed into its COPY gets the edge's body
# deadline on top (batches.surfaces.native.submit.store_native_streaming).
RELAY_DB_STATEMENT_TIMEOUT_MS = env.int("RELAY_DB_STATEMENT_TIMEOUT_MS", default=60_000)
# DATABASE_URL reaches PostgreSQL through a transaction-mode pooler (PgBouncer `pool_mode = transaction`):
# each transaction may run on another server connection, so the relay keeps no state across
# transactions (docs/pooler.md): no prepared statements, no connect-time `options`, no session SET,
# no server-side cursors. DATABASE_DIRECT_URL reaches PostgreSQL itself: the `direct` alias, for what
# must hold a session (`manage.py migrate --database direct`).
DATABASE_POOLER = env.str("DATABASE_POOLER", default="")
DATABASE_DIRECT_URL = env.str("DATABASE_DIRECT_URL", default="")
if DATABASE_POOLER not in ("", "transaction"):
    raise ImproperlyConfigured("DATABASE_POOLER must be 'transaction' (a transaction-mode pooler) or empty")
# How the timeouts below reach the server: `session` (connect-time `options`), `transaction` (SET LOCAL at
# the start of every transaction: the only way through a transaction-mode pooler, which refuses
# `options`), `role` (none: the operator set them on the role, `ALTER ROLE … SET`, docs/pooler.md).
RELAY_DB_TIMEOUTS = env.str("RELAY_DB_TIMEOUTS", default="transaction" if DATABASE_POOLER else "session")
if RELAY_DB_TIMEOUTS not in ("session", "transaction", "role"):
    raise ImproperlyConfigured("RELAY_DB_TIMEOUTS must be 'session', 'transaction' or 'role'")
if DATABASE_POOLER and RELAY_DB_TIMEOUTS == "session":
    raise ImproperlyConfigured("RELAY_DB_TIMEOUTS=session needs connect-time options, which PgBouncer refuses")
# One frozen process (a paused VM, a half-open connection) must not stall the others: no statement
# runs, no lock is waited for and no transaction idles past these, and a dead peer is noticed by
# TCP keepalives instead of hanging a worker for the kernel's default two hours.
RELAY_DB_TIMEOUTS_MS = {
    "statement_timeout": RELAY_DB_STATEMENT_TIMEOUT_MS,
    "lock_timeout": env.int("RELAY_DB_LOCK_TIMEOUT_MS", default=10_000),
    "idle_in_transaction_session_timeout": env.int("RELAY_DB_IDLE_IN_TRANSACTION_TIMEOUT_MS", default=30_000),
}


def _postgresql(db: dict, *, pooler: str, timeouts: str) -> None:
    """The relay's PostgreSQL backend (core/db/postgresql) and its connection options for `db`."""
    db["ENGINE"] = "core.db.postgresql"
    options = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3}
    if timeouts == "session":
        options["options"] = " ".join(f"-c {name}={value}" for name, value in RELAY_DB_TIMEOUTS_MS.items())
    elif timeouts == "transaction":
        db["TIMEOUTS_PER_TRANSACTION"] = RELAY_DB_TIMEOUTS_MS  # read by core/db/postgresql
    if pooler:
        db["POOLER"] = pooler
        # Django's .iterator() holds a cursor WITH HOLD across transactions in autocommit: lost behind
        # a transaction pooler, which hands the next transaction another server connection.
        db["DISABLE_SERVER_SIDE_CURSORS"] = True
    db.setdefault("OPTIONS", {}).update({**options, "connect_timeout": 10})


if DATABASES["default"]["ENGINE"].endswith("postgresql"):
    _postgresql(DATABASES["default"], pooler=DATABASE_POOLER, timeouts=RELAY_DB_TIMEOUTS)
    if DATABASE_DIRECT_URL:
        DATABASES["direct"] = env.db_url_config(DATABASE_DIRECT_URL)
        DATABASES["direct"]["CONN_MAX_AGE"] = 0  # migrations and one-off sessions: nothing to keep
        # A session of its own: the timeouts as connect-time options (or the role's), never SET LOCAL.
        _postgresql(DATABASES["direct"], pooler="", timeouts="role" if RELAY_DB_TIMEOUTS == "role" else "session")
        # The same database as `default`: the test suite makes no second test database for it.
        DATABASES["direct"]["TEST"] = {"MIRROR": "default"}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # The web server, the worker and the sweeper all write to one file: wait for
    # the lock instead of failing with "database is locked".
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"timeout": 30, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"}
    )
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
# Serve the admin's assets straight from the apps: no collectstatic step.
WHITENOISE_USE_FINDERS = True
FORMS_URLFIELD_ASSUME_HTTPS = True

REST_FRAMEWORK = {
    # Inference and batch endpoints authenticate with relay keys / tokens
    # themselves (core.auth); DRF's own auth would answer in the wrong shape.
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": [],
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "EXCEPTION_HANDLER": "core.errors.drf_exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}

# OpenAPI schema (/api/schema/, docs at /api/docs/). The views build their own JSON,
# so the shapes are declared in relay/openapi.py. OpenAPI 3.1: its schemas are JSON Schema.
SPECTACULAR_SETTINGS = {
    "TITLE": "Relay batch API",
    "DESCRIPTION": "LLM gateway with batch inference: live calls, relay-native batches, "
    "OpenAI-compatible files and batches, usage.",
    "VERSION": "1",
    "OAS_VERSION": "3.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SERVE_AUTHENTICATION": [],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "PREPROCESSING_HOOKS": ["relay.openapi.preprocess"],
    "POSTPROCESSING_HOOKS": ["relay.openapi.postprocess"],
    "COMPONENT_SPLIT_REQUEST": False,
    "DISABLE_ERRORS_AND_WARNINGS": True,
}

# --- Relay ---------------------------------------------------------------
MiB = 1024 * 1024
RELAY_MAX_REQUEST_BYTES = env.int("RELAY_MAX_REQUEST_BYTES", default=32 * MiB)
# The edge (gateway.edge, decision 0008): longest URL (path + query) accepted, else 414; how long a
# request body may take to arrive: RELAY_BODY_READ_SECONDS plus one second per
# RELAY_BODY_MIN_RATE bytes declared, with at most RELAY_BODY_IDLE_SECONDS between two
# reads (else 408) — so a slow client cannot hold a server thread.
RELAY_MAX_URL_CHARS = env.int("RELAY_MAX_URL_CHARS", default=4096)
RELAY_BODY_READ_SECONDS = env.float("RELAY_BODY_READ_SECONDS", default=30.0)
RELAY_BODY_MIN_RATE = env.int("RELAY_BODY_MIN_RATE", default=64 * 1024)
RELAY_BODY_IDLE_SECONDS = env.float("RELAY_BODY_IDLE_SECONDS", default=15.0)
RELAY_BATCH_MAX_ITEMS = env.int("RELAY_BATCH_MAX_ITEMS", default=50_000)
RELAY_BATCH_PAYLOAD_DIR = env.str("RELAY_BATCH_PAYLOAD_DIR", default="relay-batch-payloads")
# Rotation grace is capped like the product's keyRotateMaxGrace.
RELAY_KEY_ROTATE_MAX_GRACE_SECONDS = env.int("RELAY_KEY_ROTATE_MAX_GRACE_SECONDS", default=24 * 3600)
# Upstream call budget: connect timeout, per-read timeout and a total deadline.
RELAY_UPSTREAM_CONNECT_TIMEOUT = env.float("RELAY_UPSTREAM_CONNECT_TIMEOUT", default=10.0)
RELAY_UPSTREAM_READ_TIMEOUT = env.float("RELAY_UPSTREAM_READ_TIMEOUT", default=120.0)
RELAY_UPSTREAM_DEADLINE = env.float("RELAY_UPSTREAM_DEADLINE", default=300.0)

# --- Celery (namespace CELERY_) ---------------------------------------------
CELERY_BROKER_URL = env.str("CELERY_BROKER_URL", default=REDIS_URL)
CELERY_TASK_IGNORE_RESULT = True  # results live in Postgres, never in the broker
CELERY_TASK_ACKS_LATE = True  # safe: the claim in Postgres makes redelivery harmless
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_REJECT_ON_WORKER_LOST = False  # the sweeper rescues crashed items
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": 3600,
    "health_check_interval": 30,
    "socket_keepalive": True,
}
CELERY_TASK_DEFAULT_QUEUE = queues.DEFAULT_QUEUE
CELERY_TASK_ALWAYS_EAGER = env.bool("CELERY_TASK_ALWAYS_EAGER", default=False)
# beat's state file: never in the working directory (embedded mode and compose pass their own -s).
CELERY_BEAT_SCHEDULE_FILENAME = env.str(
    "CELERY_BEAT_SCHEDULE_FILENAME", default=str(Path(tempfile.gettempdir()) / "relay-celerybeat-schedule")
)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    # No known host-key value reaches a log line (core.scrub).
    "filters": {"scrub": {"()": "core.scrub.ScrubFilter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain", "filters": ["scrub"]}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
}

# --- Batches ---------------------------------------------------------------
# `dir` (files under RELAY_BATCH_PAYLOAD_DIR; every replica must mount it), `db` (PostgreSQL rows every
# replica sees) or `s3` (objects in an S3-compatible bucket: docs/object-storage.md).
RELAY_BATCH_PAYLOAD_STORE = env.str("RELAY_BATCH_PAYLOAD_STORE", default="dir")
if RELAY_BATCH_PAYLOAD_STORE not in ("dir", "db", "s3"):
    raise ImproperlyConfigured("RELAY_BATCH_PAYLOAD_STORE must be 'dir', 'db' or 's3'")
# The s3 store: bucket (must exist), endpoint (unset: AWS S3), region, key prefix. Credentials: the
# standard AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (unset: boto3's chain), read by batches/storage_s3.py.
RELAY_S3_BUCKET = env.str("RELAY_S3_BUCKET", default="")
RELAY_S3_ENDPOINT_URL = env.str("RELAY_S3_ENDPOINT_URL", default="")
RELAY_S3_REGION = env.str("RELAY_S3_REGION", default="us-east-1")
RELAY_S3_PREFIX = env.str("RELAY_S3_PREFIX", default="relay/")
RELAY_BATCH_ITEM_DEADLINE_SECONDS = env.float("RELAY_BATCH_ITEM_DEADLINE_SECONDS", default=300.0)
# A running item's lease; its heartbeat renews it every RELAY_BATCH_HEARTBEAT_SECONDS
# and reads the batch's cancel flag at the same time.
RELAY_BATCH_LEASE_SECONDS = env.int("RELAY_BATCH_LEASE_SECONDS", default=60)
RELAY_BATCH_HEARTBEAT_SECONDS = env.float("RELAY_BATCH_HEARTBEAT_SECONDS", default=2.0)
# How often the sweeper re-dispatches lost wake-ups and rescues expired leases.
RELAY_BATCH_SWEEP_SECONDS = env.float("RELAY_BATCH_SWEEP_SECONDS", default=5.0)
# Wake-up messages one top-up queues in Redis at most (a bounded window, not one per item). It does not
# cap the work in flight: every drain that finds work passes one wake-up on while none is waiting, so
# the slots of every worker consuming the queue fill within a few claims (batches.lifecycle.pass_on).
RELAY_BATCH_WAKEUP_WINDOW = env.int("RELAY_BATCH_WAKEUP_WINDOW", default=16)
# A drain claims its next item while the current one calls out (batches.worker.drain) only while
# the batch has more than this many items after the current one: near a batch's end, an item claimed
# ahead would wait for this slot's call while another slot stands idle. At least twice the slots of
# the whole fleet; 0 turns claiming ahead off.
RELAY_BATCH_CLAIM_AHEAD_MIN_LEFT = env.int("RELAY_BATCH_CLAIM_AHEAD_MIN_LEFT", default=64)

# --- Retention (batches/retention.py; the `retention` beat job) ------------------------
# How often expired files, old native batches and pruned credentials are removed.
RELAY_RETENTION_SWEEP_SECONDS = env.float("RELAY_RETENTION_SWEEP_SECONDS", default=300.0)
# Native batches (decision 0003) finished longer ago than this are deleted with their payloads
# (rows, request and response bodies). 0 keeps them until deleted by hand.
RELAY_NATIVE_BATCH_RETENTION_SECONDS = env.int("RELAY_NATIVE_BATCH_RETENTION_SECONDS", default=0)
# An ended OpenAI-surface batch (completed, failed, expired, cancelled) ended longer ago than this loses
# its items — rows and stored request and response bodies — while its batch object stays readable with
# its request counts frozen: its output and error files hold the results (and expire on their own, with
# output_expires_after). 30 days by default — OpenAI's longest output_expires_after, and a month in which
# retry_failed and the admin's per-item view still work; 0 keeps the items until the batch is deleted.
RELAY_OPENAI_ITEM_RETENTION_SECONDS = env.int("RELAY_OPENAI_ITEM_RETENTION_SECONDS", default=30 * 24 * 3600)
# An ended Anthropic-surface batch (processing_status `ended`) created longer ago than this has its results
# archived, as Anthropic's are "available for 29 days after creation": its items and stored request and
# result bodies are removed, the batch stays readable (request_counts frozen, `archived_at` set) and its
# results download answers 404. Counted from creation, like Anthropic; a batch still open that long is left
# alone (and logged). 29 days by default; 0 keeps the results until the batch is deleted.
RELAY_ANTHROPIC_RESULTS_RETENTION_SECONDS = env.int("RELAY_ANTHROPIC_RESULTS_RETENTION_SECONDS", default=29 * 24 * 3600)
# Revoked inference tokens are remembered until they would have expired anyway, plus this margin.
RELAY_REVOKED_TOKEN_PRUNE_MARGIN_SECONDS = env.int("RELAY_REVOKED_TOKEN_PRUNE_MARGIN_SECONDS", default=3600)
# Payload-store entries younger than this are never called orphans (an upload or ingest in flight).
RELAY_ORPHAN_GRACE_SECONDS = env.int("RELAY_ORPHAN_GRACE_SECONDS", default=3600)


# Waiting and retrying (batches/retrying.py). Attempts an item may use on surfaces that retry
# (OpenAI-compatible; native batches that opt in set their own): transient failures count,
# waits for capacity don't.
RELAY_BATCH_MAX_ATTEMPTS = env.int("RELAY_BATCH_MAX_ATTEMPTS", default=5)
if not 1 <= RELAY_BATCH_MAX_ATTEMPTS <= 100:
    raise ImproperlyConfigured("RELAY_BATCH_MAX_ATTEMPTS must be between 1 and 100")
# Backoff after a transient failure: full jitter over base × 2^(n-1), capped.
RELAY_BATCH_RETRY_BASE_SECONDS = env.float("RELAY_BATCH_RETRY_BASE_SECONDS", default=1.0)
RELAY_BATCH_RETRY_MAX_SECONDS = env.float("RELAY_BATCH_RETRY_MAX_SECONDS", default=60.0)
# No item waits for capacity (or retries) once this long has passed since its batch was submitted.
RELAY_BATCH_MAX_WAIT_SECONDS = env.int("RELAY_BATCH_MAX_WAIT_SECONDS", default=24 * 3600)

# Item work on `batch` (the 8-slot item worker); everything else of batches — sweeping,
# validation, finalization, retention — on `control`, its own worker (relay/processes.py).
CELERY_TASK_ROUTES = queues.TASK_ROUTES
# /metrics' usage rollup catches up on the events written since its last count (relay/metrics_rollup.py).
RELAY_METRICS_ROLLUP_SECONDS = env.float("RELAY_METRICS_ROLLUP_SECONDS", default=15.0)
CELERY_BEAT_SCHEDULE = {
    "batch-sweeper": {"task": "batches.tasks.sweep", "schedule": RELAY_BATCH_SWEEP_SECONDS},
    "retention": {"task": "batches.tasks.retention", "schedule": RELAY_RETENTION_SWEEP_SECONDS},
    "metrics-rollup": {"task": "relay.tasks.roll_up_metrics", "schedule": RELAY_METRICS_ROLLUP_SECONDS},
}

# --- Batches: the OpenAI-compatible surface (Files + Batch objects, decision 0005) ---
# Largest file POST /v1/files accepts (OpenAI's Batch API limit is 200 MB); larger → 413.
RELAY_MAX_UPLOAD_BYTES = env.int("RELAY_MAX_UPLOAD_BYTES", default=200 * MiB)
# Uploads in flight at once per credential (counted in Redis); one more → 429.
RELAY_MAX_CONCURRENT_UPLOADS = env.int("RELAY_MAX_CONCURRENT_UPLOADS", default=4)
# completion_window "24h": expires_at = created_at + this. Shorter only for tests and demos.
RELAY_BATCH_COMPLETION_WINDOW_SECONDS = env.int("RELAY_BATCH_COMPLETION_WINDOW_SECONDS", default=24 * 3600)
# What an OpenAI-surface batch costs less than the same calls made live, in whole percent.
RELAY_BATCH_DISCOUNT_PERCENT = env.int("RELAY_BATCH_DISCOUNT_PERCENT", default=50)
if not 0 <= RELAY_BATCH_DISCOUNT_PERCENT <= 100:
    raise ImproperlyConfigured("RELAY_BATCH_DISCOUNT_PERCENT must be between 0 and 100")
# Provider batch mode (batches/provider/, docs/provider-batches.md). A job is polled at most once per
# RELAY_PROVIDER_POLL_SECONDS (12 s: at most 5 polls of one job in any minute), backing off to
# RELAY_PROVIDER_POLL_MAX_SECONDS while it runs. RELAY_PROVIDER_JOB_MAX_RECORDS caps the records of one job
# below the provider's own limit (0: the provider's, 50,000 for OpenAI and 100,000 for Anthropic).
RELAY_PROVIDER_POLL_SECONDS = env.float("RELAY_PROVIDER_POLL_SECONDS", default=12.0)
RELAY_PROVIDER_POLL_MAX_SECONDS = env.float("RELAY_PROVIDER_POLL_MAX_SECONDS", default=60.0)
RELAY_PROVIDER_JOB_MAX_RECORDS = env.int("RELAY_PROVIDER_JOB_MAX_RECORDS", default=0)

# --- Tool executors (batch tool calling) -------------------------------------
# TEST-ONLY. Never set this in production. A path to a CA bundle: when set, tool
# executors on loopback (127.0.0.0/8, ::1) are allowed and are verified against
# this CA alone, so the test suite can run real HTTPS executors on 127.0.0.1.
# Empty (the default) keeps loopback refused like every other internal address.
RELAY_TOOL_EXECUTOR_TEST_LOOPBACK_CA = env.str("RELAY_TOOL_EXECUTOR_TEST_LOOPBACK_CA", default="")

# --- Webhooks when a batch ends (batches/webhooks/, docs/webhooks.md) ------------------
# A failed delivery is retried after base × 2^(n-1) seconds, capped at the max, jittered into the upper
# half (a gap never exceeds the max), until RELAY_WEBHOOK_MAX_AGE_SECONDS after the event: then it fails.
# An endpoint whose every delivery failed for that long is paused (kept, sent when resumed).
RELAY_WEBHOOK_RETRY_BASE_SECONDS = env.float("RELAY_WEBHOOK_RETRY_BASE_SECONDS", default=5.0)
RELAY_WEBHOOK_RETRY_MAX_SECONDS = env.float("RELAY_WEBHOOK_RETRY_MAX_SECONDS", default=3600.0)
RELAY_WEBHOOK_MAX_AGE_SECONDS = env.int("RELAY_WEBHOOK_MAX_AGE_SECONDS", default=72 * 3600)
if not 0 < RELAY_WEBHOOK_RETRY_BASE_SECONDS <= RELAY_WEBHOOK_RETRY_MAX_SECONDS:
    raise ImproperlyConfigured("RELAY_WEBHOOK_RETRY_BASE_SECONDS must be > 0 and <= RELAY_WEBHOOK_RETRY_MAX_SECONDS")
# A failing endpoint not tried for this long gets its next delivery now: a receiver back from an outage
# has its backlog within about this, however far the backoff has grown.
RELAY_WEBHOOK_PROBE_SECONDS = env.float("RELAY_WEBHOOK_PROBE_SECONDS", default=30.0)
# Hosts exempt from the SSRF guard (any address, plain http allowed): development and tests only.
# Embedded mode lists 127.0.0.1 (relay/embedded.py), so a receiver on the same machine works.
RELAY_WEBHOOK_ALLOWED_HOSTS = env.list("RELAY_WEBHOOK_ALLOWED_HOSTS", default=[])
# Deliveries run in their own lane (`python -m relay.processes webhooks`, batches/webhooks/lane.py), never on
# the control queue. POSTs in flight per lane process, at most per endpoint (a failing endpoint: one) and per
# owner across every lane (counted by their leases), so one tenant's dead receivers hold only its own share.
RELAY_WEBHOOK_CONCURRENCY = env.int("RELAY_WEBHOOK_CONCURRENCY", default=64)
RELAY_WEBHOOK_ENDPOINT_IN_FLIGHT = env.int("RELAY_WEBHOOK_ENDPOINT_IN_FLIGHT", default=4)
RELAY_WEBHOOK_OWNER_IN_FLIGHT = env.int("RELAY_WEBHOOK_OWNER_IN_FLIGHT", default=8)
if not 1 <= RELAY_WEBHOOK_ENDPOINT_IN_FLIGHT <= RELAY_WEBHOOK_OWNER_IN_FLIGHT <= RELAY_WEBHOOK_CONCURRENCY:
    raise ImproperlyConfigured(
        "need 1 <= RELAY_WEBHOOK_ENDPOINT_IN_FLIGHT <= RELAY_WEBHOOK_OWNER_IN_FLIGHT <= RELAY_WEBHOOK_CONCURRENCY"
    )
# One attempt's timeouts, phase by phase: resolving the host, connecting (TCP and TLS), the answer's first
# byte, and the whole attempt from the connect to the answer's first KiB.
RELAY_WEBHOOK_DNS_TIMEOUT_SECONDS = env.float("RELAY_WEBHOOK_DNS_TIMEOUT_SECONDS", default=2.0)
RELAY_WEBHOOK_CONNECT_TIMEOUT_SECONDS = env.float("RELAY_WEBHOOK_CONNECT_TIMEOUT_SECONDS", default=3.0)
RELAY_WEBHOOK_FIRST_BYTE_TIMEOUT_SECONDS = env.float("RELAY_WEBHOOK_FIRST_BYTE_TIMEOUT_SECONDS", default=5.0)
RELAY_WEBHOOK_TIMEOUT_SECONDS = env.float("RELAY_WEBHOOK_TIMEOUT_SECONDS", default=10.0)
# The lane looks for due deliveries at least this often (a committed event wakes it at once through Redis).
RELAY_WEBHOOK_POLL_SECONDS = env.float("RELAY_WEBHOOK_POLL_SECONDS", default=1.0)
# Endpoints one owner may register; one more is a 400.
RELAY_WEBHOOK_MAX_ENDPOINTS = env.int("RELAY_WEBHOOK_MAX_ENDPOINTS", default=20)
# An endpoint is paused automatically (its owner sees `paused_reason`) once every attempt has failed for this
# long, and at least RELAY_WEBHOOK_PAUSE_AFTER_FAILURES attempts in a row.
RELAY_WEBHOOK_PAUSE_AFTER_SECONDS = env.int("RELAY_WEBHOOK_PAUSE_AFTER_SECONDS", default=24 * 3600)
RELAY_WEBHOOK_PAUSE_AFTER_FAILURES = env.int("RELAY_WEBHOOK_PAUSE_AFTER_FAILURES", default=20)
# Delivered and failed deliveries (with their attempts) are deleted this long after their last attempt; 0 keeps them.
RELAY_WEBHOOK_RETENTION_SECONDS = env.int("RELAY_WEBHOOK_RETENTION_SECONDS", default=30 * 24 * 3600)
