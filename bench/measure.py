"""What the benchmarks measure and how they print it, read from /proc and PostgreSQL: the process
tree, peak RSS (MemWatch), CPU per group of processes and the machine's load (CpuWatch), the
benchmark database's backends, percentiles and tables.
"""

import contextlib
import os
import threading
import time

MiB = 1024 * 1024


# --- processes ---------------------------------------------------------------------------------------


_ppid_cache: dict = {"at": 0.0, "map": {}}
_ppid_lock = threading.Lock()


def _ppid_map(max_age: float = 0.25) -> dict[int, int]:
    """pid -> parent pid of every process, from one pass over /proc (reused for `max_age` seconds)."""
    with _ppid_lock:
        if time.monotonic() - _ppid_cache["at"] < max_age:
            return _ppid_cache["map"]
        out = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    stat = fh.read()
            except OSError:
                continue
            # pid (comm) state ppid …; comm may contain spaces, so split after the last ')'.
            out[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        _ppid_cache.update(at=time.monotonic(), map=out)
        return out


def children_of(pid: int) -> list[int]:
    return sorted(p for p, parent in _ppid_map(max_age=0).items() if parent == pid)


# --- memory ----------------------------------------------------------------------------------------


def _status_kib(pid: int, field_name: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


class MemWatch:
    """Peak RSS of some processes over a window: VmHWM after resetting it (clear_refs 5), plus
    VmRSS polled every 10 ms as a cross-check (and as the only source if the reset is refused)."""

    def __init__(self, pids: list[int]):
        self.pids = list(pids)
        self.baseline = {pid: _status_kib(pid, "VmRSS") for pid in self.pids}
        self.polled = dict(self.baseline)
        self.hwm_reset = True
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/clear_refs", "w") as fh:
                    fh.write("5")
            except OSError:
                self.hwm_reset = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> "MemWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = {}
        for pid in self.pids:
            hwm = _status_kib(pid, "VmHWM") if self.hwm_reset else 0
            self.peak[pid] = max(hwm, self.polled[pid])

    def _poll(self) -> None:
        while not self._stop.wait(0.01):
            for pid in self.pids:
                with contextlib.suppress(OSError):
                    self.polled[pid] = max(self.polled[pid], _status_kib(pid, "VmRSS"))

    def summary(self) -> dict:
        """The worker that grew most is the one that served the request."""
        pid = max(self.pids, key=lambda p: self.peak[p] - self.baseline[p])
        return {
            "pid": pid,
            "baseline_mib": self.baseline[pid] / 1024,
            "peak_mib": self.peak[pid] / 1024,
            "growth_mib": (self.peak[pid] - self.baseline[pid]) / 1024,
            "baseline_all_mib": [self.baseline[p] / 1024 for p in self.pids],
            "source": "VmHWM (reset) + VmRSS poll" if self.hwm_reset else "VmRSS poll every 10 ms",
        }


def fmt_mem(m: dict) -> str:
    return f"peak {m['peak_mib']:.1f} MiB RSS (baseline {m['baseline_mib']:.1f} MiB, +{m['growth_mib']:.1f} MiB)"


# --- CPU -------------------------------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    kids: dict[int, list[int]] = {}
    for p, parent in _ppid_map().items():
        kids.setdefault(parent, []).append(p)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def _machine_ticks() -> tuple[int, int, int]:
    with open("/proc/stat") as fh:
        v = [int(x) for x in fh.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal …
    return v[0] + v[1] + v[2] + v[5] + v[6], v[7], sum(v[:8])


class CpuWatch:
    """CPU seconds used by groups of processes over a window, and how busy the whole machine was.

    `groups` maps a label to a function returning the pids of that group now. Processes come and go
    (PostgreSQL backends are recycled with CONN_MAX_AGE), so every group is sampled every second: a
    process counts from its value at the start (or from zero if it appeared later) to the last value
    seen, which loses at most the last second of a process that ended inside the window."""

    def __init__(self, groups: dict, interval: float = 1.0):
        self.groups = groups
        self.interval = interval
        self._first: dict = {name: {} for name in groups}
        self._last: dict = {name: {} for name in groups}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self, initial: bool) -> None:
        for name, fn in self.groups.items():
            for p in fn():
                value = cpu_seconds(p)
                if value is None:
                    continue
                self._first[name].setdefault(p, value if initial else 0.0)
                self._last[name][p] = value

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):
                self._sample(False)

    def __enter__(self) -> "CpuWatch":
        self.t0 = time.monotonic()
        self.m0 = _machine_ticks()
        self._sample(True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(False)
        self.elapsed = time.monotonic() - self.t0
        m1 = _machine_ticks()
        self.used = {
            name: sum(self._last[name][p] - self._first[name][p] for p in self._last[name]) for name in self.groups
        }
        self.machine_busy = (m1[0] - self.m0[0]) / _TICK / self.elapsed  # cores
        self.machine_steal = (m1[1] - self.m0[1]) / _TICK / self.elapsed

    def per_unit_ms(self, units: int) -> dict:
        return {name: used * 1000 / max(1, units) for name, used in self.used.items()}

    def describe(self, units: int, unit: str) -> str:
        parts = ", ".join(f"{name} {ms:.2f}" for name, ms in self.per_unit_ms(units).items())
        ours = sum(self.used.values()) / self.elapsed
        return (
            f"CPU ms per {unit}: {parts}; these processes used {ours:.2f} cores, the whole machine was "
            f"{self.machine_busy:.2f} of {os.cpu_count()} cores busy (steal {self.machine_steal:.2f})"
        )


_pg_local = threading.local()


def pg_backends(db_name: str, *, backend_type: str | None = None, but_app: str | None = None) -> list[int]:
    """PIDs of the PostgreSQL backends connected to our database, read through a connection of our
    own to the `postgres` database (so the observer is not one of the observed). `backend_type`: only
    those (e.g. 'client backend', leaving out autovacuum workers); `but_app`: not the connections whose
    application_name it is (a benchmark's own driver, which is not what it measures)."""
    import psycopg2

    conn = getattr(_pg_local, "conn", None)
    if conn is None or conn.closed:
        conn = _pg_local.conn = psycopg2.connect(
            f"{os.environ.get('BENCH_PG_URL', 'postgres://postgres:postgres@127.0.0.1:5432').rstrip('/')}/postgres"
        )
        conn.autocommit = True
    sql, params = "SELECT pid FROM pg_stat_activity WHERE datname = %s", [db_name]
    if backend_type is not None:
        sql, params = sql + " AND backend_type = %s", [*params, backend_type]
    if but_app is not None:
        sql, params = sql + " AND application_name <> %s", [*params, but_app]
    with conn.cursor() as cur:
        cur.execute(sql, params)
        return [row[0] for row in cur.fetchall()]


# --- statistics and output ---------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (q in 0..100)."""
    s = sorted(values)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, r in enumerate(cells):
        padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(padded))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def machine() -> str:
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = _meminfo_gib()
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Linux {os.uname().release}"


def _meminfo_gib() -> float:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024 / 1024
    return 0.0


def load() -> str:
    """The machine's load as `uptime` prints it (1, 5, 15 min), with the number of cores."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} cores"
