"""Command lines of the relay's processes, shared by embedded mode, the tests and the benchmarks,
so each runs the worker exactly as production does (compose.yaml says the same)."""

# 8 items in flight per replica, shared by all batches (design §4).
WORKER_CONCURRENCY = 8


def worker_argv(python: str, name: str, *, loglevel: str = "INFO", beat_schedule: str | None = None) -> list[str]:
    """The Celery batch worker; with `beat_schedule` it also runs the periodic jobs (-B)."""
    argv = [
        python,
        "-m",
        "celery",
        "-A",
        "relay",
        "worker",
        "-Q",
        "batch,default",
        "-c",
        str(WORKER_CONCURRENCY),
        "-P",
        "prefork",
        "--loglevel",
        loglevel,
        "-n",
        f"{name}@%h",
    ]
    if beat_schedule:
        argv += ["-B", "-s", beat_schedule]
    return argv
