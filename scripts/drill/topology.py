"""Names and addresses of the drill's hosts, and the environment every relay process runs with.

Everything lives in namespaces scripts/drill.sh made: the database host owns the bridge (10.231.0.1),
each app host one veth whose other end is a port of that bridge. No address is given outside them."""

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
PY = str(ROOT / ".venv" / "bin" / "python")

DB_IP = "10.231.0.1"
PG_PORT = 5432
PGBOUNCER_PORT = 6432
# DRILL_POOLER=pgbouncer: the app hosts reach PostgreSQL through PgBouncer (transaction mode) on the
# database host, told so (DATABASE_POOLER=transaction), with DATABASE_DIRECT_URL for what needs a session.
POOLER = os.environ.get("DRILL_POOLER", "")
REDIS_PORT = 6379
UPSTREAM_PORT = 8900
WEB_PORT = 8080
DB_NAME = "relay"
DB_USER = "relay"
DB_PASSWORD = "relay"


@dataclass(frozen=True)
class AppHost:
    name: str  # also its hostname (UTS namespace): lease owners read `drill-a1:<pid>:…`
    netns: str
    ip: str
    link: str  # its port on the database host's bridge: the link a partition cuts
    tmp: Path
    beat: bool

    @property
    def web_url(self) -> str:
        return f"http://{self.ip}:{WEB_PORT}"


@dataclass(frozen=True)
class Topology:
    tmp: Path
    db_netns: str
    apps: tuple[AppHost, AppHost]
    pgbin: str

    @classmethod
    def from_env(cls) -> "Topology":
        tmp = Path(os.environ["DRILL_TMP"])
        apps = tuple(
            AppHost(
                name=f"drill-a{n}",
                netns=os.environ[f"DRILL_NS_A{n}"],
                ip=f"10.231.0.1{n}",
                link=f"to-a{n}",
                tmp=tmp / f"a{n}",
                beat=n == 1,  # beat (the sweeper's clock) runs on the first host only, as compose runs it once
            )
            for n in (1, 2)
        )
        return cls(tmp=tmp, db_netns=os.environ["DRILL_NS_DB"], apps=apps, pgbin=os.environ["DRILL_PGBIN"])

    @property
    def direct_url(self) -> str:
        return f"postgres://{DB_USER}:{DB_PASSWORD}@{DB_IP}:{PG_PORT}/{DB_NAME}"

    @property
    def database_url(self) -> str:
        """What the app hosts use: PgBouncer's port when the drill runs one, else PostgreSQL's."""
        port = PGBOUNCER_PORT if POOLER else PG_PORT
        return f"postgres://{DB_USER}:{DB_PASSWORD}@{DB_IP}:{port}/{DB_NAME}"

    @property
    def redis_url(self) -> str:
        return f"redis://{DB_IP}:{REDIS_PORT}/0"

    @property
    def upstream_url(self) -> str:
        return f"http://{DB_IP}:{UPSTREAM_PORT}"


# Short leases so a dead or cut host's items come back in seconds, not the default minute: a lease of
# LEASE_SECONDS renewed every HEARTBEAT_SECONDS, and a sweep (the rescue) every SWEEP_SECONDS.
LEASE_SECONDS = int(os.environ.get("DRILL_LEASE_SECONDS") or 10)
HEARTBEAT_SECONDS = 2
SWEEP_SECONDS = 2


def app_env(topo: Topology, payload_dir: Path | None = None, *, direct: bool = False) -> dict:
    """The relay's settings on every host: one database and one Redis on the database host, the `db`
    payload store (no shared disk), a payload directory of the host's own (unused by the `db` store, set
    so nothing falls back to the checkout). `direct`: straight to PostgreSQL, never through the pooler
    (migrations, the seeding commands)."""
    pooled = bool(POOLER) and not direct
    pooler = {"DATABASE_POOLER": "transaction", "DATABASE_DIRECT_URL": topo.direct_url} if pooled else {}
    return {
        **pooler,
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "DJANGO_SETTINGS_MODULE": "relay.settings",
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "DATABASE_URL": topo.database_url if pooled else topo.direct_url,
        "REDIS_URL": topo.redis_url,
        "SECRET_KEY": "drill-secret-key",
        "RELAY_MASTER_KEY": "drill-master-key",
        "RELAY_ADMIN_TOKEN": "drill-admin-token",
        "DEBUG": "0",
        "RELAY_EMBEDDED": "0",
        "RELAY_BATCH_PAYLOAD_STORE": "db",
        "RELAY_BATCH_PAYLOAD_DIR": str(payload_dir or topo.tmp / "db" / "payloads"),
        "RELAY_BATCH_LEASE_SECONDS": str(LEASE_SECONDS),
        "RELAY_BATCH_HEARTBEAT_SECONDS": str(HEARTBEAT_SECONDS),
        "RELAY_BATCH_SWEEP_SECONDS": str(SWEEP_SECONDS),
        # A web server sized for the drill, not for 200 streams: 2 workers × 16 threads.
        "RELAY_WEB_THREADS": "16",
        "LOG_LEVEL": "WARNING",
    }
