"""Guards of the engine's structure: one home for state changes, no import cycle in batches/.

Static checks over the source (no database): they fail the moment a module starts
writing `status`/`state` itself or importing in a circle.
"""

import ast
from pathlib import Path

BATCHES = Path(__file__).resolve().parent.parent / "batches"
HOME = BATCHES / "lifecycle"


def _sources():
    for path in sorted(BATCHES.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        yield path, ast.parse(path.read_text(), filename=str(path))


def test_only_the_lifecycle_module_writes_status_or_state():
    offenders = []
    for path, tree in _sources():
        if HOME in path.parents:
            continue
        for node in ast.walk(tree):
            # Model.objects.filter(...).update(status=…) / .update(state=…)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update":
                if any(kw.arg in ("status", "state") for kw in node.keywords):
                    offenders.append(f"{path.name}:{node.lineno} .update({', '.join(k.arg for k in node.keywords)})")
            # batch.status = …  /  item.state = …  followed by a save()
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and target.attr in ("status", "state"):
                        offenders.append(f"{path.name}:{node.lineno} assigns .{target.attr}")
    assert offenders == [], "status/state written outside batches/lifecycle/: " + "; ".join(offenders)


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(BATCHES.parent).with_suffix("").parts).removesuffix(".__init__")


MODULES = {_module_name(p) for p in BATCHES.rglob("*.py") if "migrations" not in p.parts}


def _imports(tree) -> set[str]:
    """The batches modules a module imports at module level (lazy imports inside functions don't form cycles).
    `from batches.tools import netguard` imports the submodule, not the package's own code."""
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "batches":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("batches."))
    return found


def test_batches_has_no_import_cycle():
    graph = {}
    for path, tree in _sources():
        graph[_module_name(path)] = _imports(tree)

    def visit(node, stack, seen):
        if node in stack:
            return stack[stack.index(node) :] + [node]
        if node in seen or node not in graph:
            return None
        seen.add(node)
        for dep in sorted(graph[node]):
            cycle = visit(dep, stack + [node], seen)
            if cycle:
                return cycle
        return None

    seen: set[str] = set()
    for module in sorted(graph):
        cycle = visit(module, [], seen)
        assert cycle is None, "import cycle: " + " → ".join(cycle)


# The batch engine's rooms depend on each other one way, bottom up (docs/architecture.md): each module
# may import only these of batches (any other package is free), at module level or inside a function.
LAYERS = {
    "batches.lifecycle.states": {"batches.models", "batches.outcomes"},
    "batches.lifecycle.sql": {"batches.models", "batches.lifecycle.states"},
    "batches.dispatch": {"batches.models", "batches.queues", "batches.lifecycle.states"},
    # The surface registry: a leaf the lifecycle reads and each surface package fills (decision 0019).
    "batches.surfaces.registry": {"batches.models"},
    "batches.lifecycle.stop": {
        "batches.models",
        "batches.outcomes",
        "batches.errors",
        "batches.dispatch",
        "batches.lifecycle.states",
        "batches.surfaces.registry",
    },
    "batches.lifecycle.finish": {
        "batches.models",
        "batches.outcomes",
        "batches.dispatch",
        "batches.lifecycle.states",
        "batches.lifecycle.sql",
        "batches.lifecycle.stop",
    },
    "batches.lifecycle.claim": {
        "batches.models",
        "batches.lifecycle.states",
        "batches.lifecycle.sql",
        "batches.lifecycle.stop",
        "batches.lifecycle.finish",
    },
}


def _all_imports(tree, modules) -> set[str]:
    """Every import of a module, inside functions too, resolved to the modules in `modules`."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & modules


def test_the_lifecycle_rooms_import_only_what_is_below_them():
    for module, allowed in LAYERS.items():
        path = BATCHES.parent / (module.replace(".", "/") + ".py")
        imported = _all_imports(ast.parse(path.read_text()), MODULES)
        assert imported <= allowed, f"{module} imports {sorted(imported - allowed)}"


def test_the_celery_app_imports_nothing_of_the_batch_engine():
    tree = ast.parse((BATCHES.parent / "relay" / "celery.py").read_text())
    assert not {m for m in _all_imports(tree, MODULES)}


PROJECT = [BATCHES.parent / name for name in ("core", "usage", "policies", "gateway", "batches", "relay", "devkit")]


def test_the_project_has_no_import_cycle_not_even_inside_functions():
    paths = [p for root in PROJECT for p in root.rglob("*.py") if "migrations" not in p.parts]

    def name(path: Path) -> str:
        return ".".join(path.relative_to(BATCHES.parent).with_suffix("").parts).removesuffix(".__init__")

    modules = {name(p) for p in paths}
    graph = {name(p): _all_imports(ast.parse(p.read_text()), modules) - {name(p)} for p in paths}
    # A package's __init__ is imported with any of its modules; it imports nothing of its own here.
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [node, dep] if dep in stack else [node, dep]
            if dep not in state:
                cycle = visit(dep, stack + [node])
                if cycle:
                    return cycle
        state[node] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [])
            assert cycle is None, "import cycle: " + " → ".join(cycle)
