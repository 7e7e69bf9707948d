"""The drill's scenarios and its report (run by scripts/drill.sh inside the database host's namespace).

Each scenario submits its own six batches (OpenAI, Anthropic, native through each app host's web server),
lets them start, disturbs the deployment, waits until every item is final, then reads the items, their
usage events, attempts and stored results from PostgreSQL and the results back through the API, and
prints `scenario NAME: items N, final N, usage events N, lost N, duplicated N, recovered in S s` —
recovered: seconds from the disturbance until every item of the scenario was final. Exit status 1 when
any scenario lost or duplicated anything (or did not finish)."""

import logging
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from drill import ledger, stack, workload
from drill import topology as t

log = logging.getLogger("drill")

RECORDS = int(os.environ.get("DRILL_RECORDS") or 60)
DELAY_MS = float(os.environ.get("DRILL_DELAY_MS") or 500)
PARTITION_SECONDS = float(os.environ.get("DRILL_PARTITION_SECONDS") or 30)
DONE_TIMEOUT = float(os.environ.get("DRILL_DONE_TIMEOUT") or 240)
# After a cut link comes back, how long the cut host may take to try its late writes: TCP resends what the
# cut held back on its own backoff (about 21 s after a 30 s cut), then the write is made.
LATE_WRITE_WAIT = float(os.environ.get("DRILL_LATE_WRITE_WAIT") or 30)
SCENARIOS = ("kill_host", "partition", "redis_restart", "postgres_restart")


def say(msg: str) -> None:
    print(f"[drill {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Drill:
    topo: t.Topology
    db: stack.DatabaseHost
    apps: list[stack.AppProcesses]
    key: str = ""
    cleanups: list = field(default_factory=list)

    @property
    def survivor(self) -> stack.AppProcesses:
        return self.apps[0]  # the host with beat: never the one killed or cut

    @property
    def victim(self) -> stack.AppProcesses:
        return self.apps[1]

    def connections(self) -> str:
        parts = []
        for app in self.apps:
            if not app.procs:
                continue
            pg = stack.connections_by_role(app, t.PGBOUNCER_PORT if t.POOLER else t.PG_PORT)
            rd = stack.connections_by_role(app, t.REDIS_PORT)
            roles = sorted(set(pg) | set(rd))
            parts.append(f"{app.host.name}: " + ", ".join(f"{r} {pg.get(r, 0)};{rd.get(r, 0)}" for r in roles))
        return " | ".join(parts)

    # --- one scenario ---

    def submit(self, name: str) -> list[workload.Submitted]:
        subs = workload.submit_all(self.topo.apps, self.key, name, RECORDS)
        say(
            f"{name}: submitted {len(subs)} batches × {RECORDS} records, "
            f"through {', '.join(h.name for h in self.topo.apps)}"
        )
        return subs

    def wait_started(self, ids: list[str], total: int, victim_busy: bool) -> None:
        """Until a sixth of the items are final (and, for a scenario aimed at the second host, it holds some)."""

        def started():
            p = ledger.progress(self.topo, ids)
            final = sum(n for s, n in p["states"].items() if s in ledger.FINAL)
            if final < total // 6:
                return False
            return not victim_busy or ledger.running_on(self.topo, ids, self.victim.host.name)

        stack.wait_for("batches started", started, timeout=180, every=0.25)

    def wait_done(self, ids: list[str], total: int) -> float | None:
        """Until every item is final and every batch ended; the moment it was (monotonic), None on timeout."""
        deadline = time.monotonic() + DONE_TIMEOUT
        while time.monotonic() < deadline:
            p = ledger.progress(self.topo, ids)
            final = sum(n for s, n in p["states"].items() if s in ledger.FINAL)
            if final >= total and not p["open"]:
                return time.monotonic()
            time.sleep(0.25)
        p = ledger.progress(self.topo, ids)
        say(f"not finished after {DONE_TIMEOUT:.0f} s: items {p['states']}, open batches {p['open']}")
        return None

    def tally(self, subs: list[workload.Submitted]) -> ledger.Tally:
        ids = [s.db_id for s in subs]
        api = {}
        for s in subs:
            try:
                api[s.db_id] = workload.result_ids(self.survivor.host, self.key, s)
            except Exception as exc:  # counted as lost below, and said why
                say(f"results of {s.surface} batch {s.api_id}: {str(exc).splitlines()[0][:300]}")
                api[s.db_id] = []
        return ledger.account(
            {s.db_id: s.records for s in subs},
            ledger.items(self.topo, ids),
            api,
            {s.db_id: s.custom_ids for s in subs},
            {h.name: h.ip for h in self.topo.apps},
        )

    def scenario(self, name: str, disturb, victim_busy: bool = False) -> ledger.Tally:
        subs = self.submit(name)
        ids, total = [s.db_id for s in subs], sum(s.records for s in subs)
        self.wait_started(ids, total, victim_busy)
        say(f"{name}: connections now (PostgreSQL; Redis): {self.connections()}")
        began = time.monotonic()
        after = disturb(ids)
        done = self.wait_done(ids, total)
        if after is not None:
            after(ids)
        tally = self.tally(subs)
        if done is None:
            tally.notes.append("the scenario's batches did not finish in time")
            tally.lost = max(tally.lost, tally.items - tally.final)
        print(tally.line(name, (done or time.monotonic()) - began), flush=True)
        for note in tally.notes[:20]:
            say(f"  {note}")
        return tally

    # --- the disturbances ---

    def kill_host(self, ids):
        held = ledger.running_on(self.topo, ids, self.victim.host.name)
        n = self.victim.kill_all()
        say(f"kill_host: SIGKILL to all {n} processes of {self.victim.host.name}, which held {len(held)} running items")

        def after(_ids):
            claims = ledger.claims_of(self.topo, [i for i, _ in held])
            rescued = sum(1 for i, a in held if claims[i][1] > a and claims[i][2] == self.survivor.host.name)
            say(
                f"kill_host: of its {len(held)} items, {rescued} were rescued and finished by {self.survivor.host.name}"
            )

        return after

    def partition(self, ids):
        """The link comes back PARTITION_SECONDS later, on a timer: the batches may well finish meanwhile."""
        host = self.victim.host
        held = ledger.running_on(self.topo, ids, host.name)
        stack.set_link(self.topo, host, up=False)
        say(f"partition: {host.name}'s link down for {PARTITION_SECONDS:.0f} s; it held {len(held)} running items")
        restored = threading.Event()

        def restore():
            stack.set_link(self.topo, host, up=True)
            say(f"partition: {host.name}'s link up again")
            restored.set()

        timer = threading.Timer(PARTITION_SECONDS, restore)
        timer.start()

        def after(_ids):
            restored.wait()
            timer.join()
            # Give the cut host the time to try its late writes, then look at what it managed.
            time.sleep(LATE_WRITE_WAIT)
            claims = ledger.claims_of(self.topo, [i for i, _ in held])
            rescued = [i for i, a in held if claims[i][1] > a]
            kept = [i for i, a in held if claims[i][1] == a]
            dropped = _log_mentions(self.victim, rescued, "lost its lease")
            refused, _ = ledger.late_results(self.topo, rescued, host.ip)
            say(
                f"partition fence: {len(held)} items held by {host.name} when cut: {len(rescued)} rescued and "
                f"finished by another claim, {len(kept)} finished by its own claim before its lease ran out. "
                f"Its late writes for the rescued ones: {dropped} results dropped at its heartbeat's fence, "
                f"{refused} results stored then refused by the finish's fence (the item kept its rescuer's); "
                f"one let through is counted duplicated below"
            )

        self.cleanups.append(lambda: (timer.cancel(), stack.set_link(self.topo, host, up=True)))
        return after

    def redis_restart(self, ids):
        r = redis.Redis(host=t.DB_IP, port=t.REDIS_PORT)
        before = r.dbsize()
        self.db.stop_redis()
        say(f"redis_restart: Redis stopped ({before} keys, AOF fsynced on shutdown)")
        time.sleep(3)
        self.db.start_redis()
        say(f"redis_restart: Redis back: {r.dbsize()} keys replayed from the AOF")
        return None

    def postgres_restart(self, ids):
        self.db.stop_postgres()
        say("postgres_restart: PostgreSQL stopped (fast shutdown: every session cut)")
        time.sleep(3)
        self.db.start_postgres()
        say("postgres_restart: PostgreSQL back")
        return None


def _log_mentions(app: stack.AppProcesses, item_ids: list[str], text: str) -> int:
    found = set()
    for path in app.logs():
        if not path.name.startswith("worker"):
            continue
        for line in path.read_text(errors="replace").splitlines():
            if text in line:
                found.update(i for i in item_ids if i in line)
    return len(found)


def _dump_logs(drill: Drill) -> None:
    keep = os.environ.get("DRILL_LOGS")
    if keep:
        dest = Path(keep)
        dest.mkdir(parents=True, exist_ok=True)
        for path in list(drill.topo.tmp.glob("*/*.log")):
            shutil.copy(path, dest / f"{path.parent.name}-{path.name}")
        say(f"logs copied to {dest}")
    for app in drill.apps:
        for path in app.logs():
            lines = [ln for ln in path.read_text(errors="replace").splitlines() if "ERROR" in ln or "Traceback" in ln]
            if lines:
                say(f"{app.host.name} {path.name}: {len(lines)} error lines, last: {lines[-1][:300]}")


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    topo = t.Topology.from_env()
    only = [s for s in (os.environ.get("DRILL_SCENARIOS") or ",".join(SCENARIOS)).split(",") if s]
    unknown = [s for s in only if s not in SCENARIOS]
    if t.POOLER not in ("", "pgbouncer"):
        print(f"drill: DRILL_POOLER must be 'pgbouncer' or empty, not {t.POOLER!r}", file=sys.stderr)
        return 2
    if unknown:
        print(f"drill: unknown scenario {unknown[0]!r}; known: {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    drill = Drill(topo, stack.DatabaseHost(topo, DELAY_MS), [stack.AppProcesses(topo, h) for h in topo.apps])
    failed = False
    try:
        started = time.monotonic()
        drill.db.init_postgres()
        if t.POOLER:
            drill.db.start_pgbouncer()
        drill.db.start_redis()
        drill.db.start_upstream()
        drill.key = workload.seed(topo)
        for app in drill.apps:
            app.start()
        say(
            f"up in {time.monotonic() - started:.0f} s: PostgreSQL, Redis (AOF), provider ({DELAY_MS:.0f} ms) on "
            f"{t.DB_IP}; web + item worker + control worker + webhook lane on "
            f"{', '.join(f'{h.name} {h.ip}' for h in topo.apps)}; "
            f"beat on {topo.apps[0].name}; payload store db; lease {t.LEASE_SECONDS} s; "
            f"{'through PgBouncer (transaction mode)' if t.POOLER else 'straight to PostgreSQL (no pooler)'}"
        )
        for name in only:
            disturb = getattr(drill, name)
            tally = drill.scenario(name, disturb, victim_busy=name in ("kill_host", "partition"))
            failed |= bool(tally.lost or tally.duplicated)
            if name == "kill_host":
                drill.victim.start()  # the host comes back for the scenarios after
                say(f"kill_host: {drill.victim.host.name} restarted")
        say(f"drill {'FAILED' if failed else 'passed'} in {time.monotonic() - started:.0f} s")
    except Exception as exc:
        failed = True
        say(f"drill aborted: {exc.__class__.__name__}: {exc}")
        raise
    finally:
        for undo in drill.cleanups:
            try:
                undo()
            except Exception:
                pass
        if failed:
            _dump_logs(drill)
        for app in drill.apps:
            app.stop()
        drill.db.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
