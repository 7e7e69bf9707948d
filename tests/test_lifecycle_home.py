"""Guards of the structure issue 9 left: one home for state changes, no import cycle in batches/.

Static checks over the source (no database): they fail the moment a module starts
writing `status`/`state` itself or importing in a circle.
"""

import ast
from pathlib import Path

BATCHES = Path(__file__).resolve().parent.parent / "batches"
HOME = BATCHES / "lifecycle.py"


def _sources():
    for path in sorted(BATCHES.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        yield path, ast.parse(path.read_text(), filename=str(path))


def test_only_the_lifecycle_module_writes_status_or_state():
    offenders = []
    for path, tree in _sources():
        if path == HOME:
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
    assert offenders == [], "status/state written outside batches/lifecycle.py: " + "; ".join(offenders)


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


def test_the_lifecycle_module_depends_only_on_models_and_outcomes():
    tree = ast.parse(HOME.read_text())
    assert _imports(tree) <= {"batches.models", "batches.outcomes"}
