"""The apps in layers: every import in the project's packages, including those inside functions and those made
by name (`import_module("...")`), runs down the layers or within one, never up. Bottom to top:

    core       tenancy, catalog, credentials, auth, Redis, errors, crypto, host kinds
    usage      pricing, usage events, spend budgets
    policies   rate limits, key pools, breakers, live-first sharing, provider quotas
    gateway    routing, adapters, the upstream choke point, the pipeline's stages, streaming, the live API
    batches    the batch engine, its surfaces, provider batch mode, webhooks
    relay      the project shell: settings, URLs, Celery app, processes, metrics, operator pages, reports
    devkit     the demo catalog and the fake providers (development only; nothing above imports it)

A layer may import any layer below it. Moving a module is a decision (docs/decisions/0020-app-layers.md)."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["core", "usage", "policies", "gateway", "batches", "relay", "devkit"]
PACKAGES = ["core", "usage", "policies", "gateway", "batches", "relay", "devkit"]


def layer_of(module: str) -> int | None:
    best = None
    for rank, prefix in enumerate(LAYERS):
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(LAYERS[best])):
            best = rank
    return best


def _imports(path: Path, module: str):
    """(line, imported module) of every import statement in the file, at any depth, and every
    importlib.import_module / __import__ call with a literal name."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            yield node.lineno, target
            for alias in node.names:  # `from core import catalog` imports core.catalog
                yield node.lineno, f"{target}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def _modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield path, ".".join(parts)


def test_every_module_belongs_to_a_layer():
    assert [m for _, m in _modules() if layer_of(m) is None] == []


def test_no_import_runs_up_the_layers():
    upward = []
    for path, module in _modules():
        mine = layer_of(module)
        for line, target in _imports(path, module):
            theirs = layer_of(target)
            if theirs is None:
                continue
            if theirs > mine:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({LAYERS[mine]}) imports {target} ({LAYERS[theirs]})")
    assert upward == [], "imports running up the layers:\n" + "\n".join(upward)


def test_the_layer_reader_sees_imports_inside_functions_and_by_name():
    # The reader itself: an import inside a function body and one by name are both found.
    src = "def f():\n    from batches import models\n    importlib.import_module('relay.console')\n"
    tree = ast.parse(src)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            found.append(node.args[0].value)
    assert found == ["batches", "relay.console"]
    assert layer_of("batches.models") > layer_of("gateway.pipeline") > layer_of("policies.keypool")
    assert layer_of("relay.console") > layer_of("batches.models") > layer_of("core.models")
