"""A process's warm-up runner, shared by the batch workers (batches.worker.warmup) and the web workers
(relay.webserver): what each warms is theirs; how a failed step is logged is one rule."""

import time


def run_warm_up(steps, log, *, what: str, first: str) -> None:
    """Run a process's warm-up `steps` ((name, callable) pairs) best effort, before it takes work: a
    step that fails is logged and left to the process's `first` request or item; then one INFO line,
    "`what` warmed up in N ms", naming any step that failed. Used by the batch workers
    (batches.worker.warmup.warm_up) and the web workers (relay.webserver.warm_up)."""
    started, failed = time.monotonic(), []
    for name, step in steps:
        try:
            step()
        except Exception:
            failed.append(name)
            log.warning("%s warm-up step %r failed; the first %s does it", what, name, first, exc_info=True)
    took = (time.monotonic() - started) * 1000
    log.info("%s warmed up in %.0f ms%s", what, took, f" (failed: {', '.join(failed)})" if failed else "")
