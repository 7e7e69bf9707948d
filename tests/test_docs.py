"""The docs: the MkDocs site builds with --strict, the README stays short, and the configuration page
names every setting relay/settings.py reads from the environment. No database, no Redis."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250


def build_docs(site_dir: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` (what `make docs` runs) into site_dir; any warning fails it."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def env_settings(path: Path = ROOT / "relay" / "settings.py") -> set[str]:
    """Every environment variable the settings module reads: `env.<cast>("NAME", …)`, `env("NAME")`, and
    calls of the module's own helpers with a NAME first (`_secret("SECRET_KEY")`)."""
    tree = ast.parse(path.read_text())
    helpers = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    names = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        first = node.args[0]
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            continue
        func = node.func
        reads_env = (
            (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "env")
            or (isinstance(func, ast.Name) and func.id == "env")
            or (isinstance(func, ast.Name) and func.id in helpers)
        )
        if reads_env and re.fullmatch(r"[A-Z][A-Z0-9_]*", first.value):
            names.add(first.value)
    return names


def test_strict_build_passes(tmp_path):
    result = build_docs(tmp_path / "site")
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    for page in ("index.html", "architecture/index.html", "configuration/index.html", "decisions/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_readme_is_short_and_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"
    assert "make run" in text and "make test" in text


def test_env_settings_are_found():
    names = env_settings()
    # A few the parser must see, of each kind of read.
    assert {"SECRET_KEY", "DATABASE_URL", "ALLOWED_HOSTS", "RELAY_BATCH_MAX_ITEMS", "DEBUG"} <= names


def test_configuration_page_lists_every_env_setting():
    page = (ROOT / "docs" / "configuration.md").read_text()
    missing = sorted(name for name in env_settings() if f"`{name}`" not in page)
    assert not missing, f"docs/configuration.md does not list: {', '.join(missing)}"
