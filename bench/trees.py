"""The two trees of `make bench`'s side by side: the previous release, checked out into a worktree of its own,
and this checkout (or BENCH_TREE). Each tree's relay runs from its own directory; the benchmark code, the
fake upstream and the client are always this checkout's (bench/sidebyside.py).

The previous release is the git ref in bench/BASELINE (its first word; `#` lines are comments), or
BENCH_BASELINE. Its worktree is `.bench/baseline` (git-ignored; BENCH_BASELINE_DIR), made on the first run
and moved to the ref, detached, whenever the ref changes. Both trees use this checkout's .venv.
"""

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bench.harness import ROOT, log

BASELINE_FILE = ROOT / "bench" / "BASELINE"


@dataclass(frozen=True)
class Tree:
    label: str  # "previous" or "this"
    path: Path
    commit: str  # short hash, "+ changes" when the tree has uncommitted edits

    def __str__(self) -> str:
        return f"{self.label} ({self.commit})"


def _git(*args: str, cwd: Path = ROOT) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {cwd}: {done.stderr.strip()}")
    return done.stdout.strip()


def baseline_ref() -> str:
    if os.environ.get("BENCH_BASELINE"):
        return os.environ["BENCH_BASELINE"].strip()
    for line in BASELINE_FILE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            return line.split()[0]
    raise RuntimeError(f"{BASELINE_FILE} names no git ref")


def _describe(path: Path) -> str:
    commit = _git("rev-parse", "--short", "HEAD", cwd=path)
    dirty = _git("status", "--porcelain", "--untracked-files=no", cwd=path)
    return f"{commit} + changes" if dirty else commit


def previous() -> Tree:
    """The baseline's worktree, made or moved to the ref (detached) when needed."""
    ref = baseline_ref()
    commit = _git("rev-parse", "--verify", f"{ref}^{{commit}}")
    path = Path(os.environ.get("BENCH_BASELINE_DIR") or ROOT / ".bench" / "baseline").resolve()
    if not (path / ".git").exists():
        log(f"checking the previous release {ref} out into {path}")
        _git("worktree", "prune")
        path.parent.mkdir(parents=True, exist_ok=True)
        _git("worktree", "add", "--detach", "--quiet", str(path), commit)
    elif _git("rev-parse", "HEAD", cwd=path) != commit:
        # The worktree is the benchmark's own (git-ignored): nothing in it is anybody's work.
        log(f"moving {path} to {ref}")
        _git("checkout", "--detach", "--quiet", "--force", commit, cwd=path)
    return Tree("previous", path, _git("rev-parse", "--short", commit))


def this() -> Tree:
    """The tree being measured: BENCH_TREE, by default the checkout this code runs from."""
    path = Path(os.environ.get("BENCH_TREE") or ROOT).resolve()
    if not (path / "relay").is_dir() or not (path / "manage.py").exists():
        raise RuntimeError(f"BENCH_TREE={path} is not a checkout of the relay (no relay/ or manage.py)")
    return Tree("this", path, _describe(path))
