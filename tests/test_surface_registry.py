"""A batch surface is one object behind one registry (docs/decisions/0019-surface-objects.md).

The registry holds one object per `Surface` choice; its ids, envelopes and webhook events agree with what the
rest of the project shows; and the modules that serve every surface (the lifecycle's loops, the sweeper, the
views, retry, webhooks) look a surface up instead of branching on its name. Static checks and the registry's
own data: no database.
"""

import ast
import uuid
from pathlib import Path

import pytest

from batches.errors import OpenAIError
from batches.models import Batch, BatchStatus, Surface
from batches.surfaces import installed, registry
from batches.webhooks import events
from core.errors import AnthropicError, RelayError

ROOT = Path(__file__).resolve().parent.parent

# The modules that serve every surface: none may branch on a surface's name. In the lifecycle's stop.py only
# its loops: its transitions are per surface by nature (`end_anthropic`, `expire_openai`, which the surface
# objects call).
SURFACE_BLIND = {
    "batches/lifecycle/stop.py": {
        "complete_if_done",
        "unfinished_batches",
        "cancel",
        "expire_due",
        "expiring",
        "expire_one",
    },
    "batches/sweeper.py": None,
    "batches/api/views.py": None,
    "batches/api/anthropic_views.py": None,
    "batches/surfaces/retry.py": None,
    "batches/surfaces/registry.py": None,
    "batches/webhooks/events.py": None,
    "batches/webhooks/outbox.py": None,
}


def test_every_surface_choice_has_exactly_one_object():
    names = [surface.name for surface in registry.all_surfaces()]
    assert names == list(Surface.values)
    assert [s.name for s in installed.SURFACES] == list(Surface.values)
    for surface in installed.SURFACES:
        assert registry.get(surface.name) is surface


def test_a_missing_surface_stops_the_start(monkeypatch):
    monkeypatch.setattr(registry, "_SURFACES", {k: v for k, v in registry._SURFACES.items() if k != Surface.ANTHROPIC})
    with pytest.raises(RuntimeError, match="anthropic"):
        registry.check_complete()


def test_register_refuses_a_name_that_is_no_choice_and_a_second_object_under_a_name():
    class Fourth(registry.BatchSurface):
        name = "fourth"

    with pytest.raises(ValueError, match="not a Surface choice"):
        registry.register(Fourth())

    class OtherNative(registry.BatchSurface):
        name = Surface.NATIVE

    with pytest.raises(ValueError, match="already NativeSurface"):
        registry.register(OtherNative())
    registry.register(type(registry.get(Surface.NATIVE))())  # the same surface again: a no-op
    assert type(registry.get(Surface.NATIVE)).__name__ == "NativeSurface"


@pytest.mark.parametrize("name", Surface.values)
def test_each_surface_reads_back_its_own_ids_and_only_those(name):
    pk = uuid.uuid4()
    surface = registry.get(name)
    public = surface.public_id(pk)
    assert public == Batch(id=pk, surface=name).public_id  # as the model (and so the admin) shows it
    assert surface.parse_id(public) == pk
    assert registry.find_id(f"  {public} ") == pk
    assert surface.parse_id(public + "\n") is None  # matched in full
    for other in registry.all_surfaces():
        if other is not surface:
            assert other.parse_id(public) is None, f"{other.name} takes {name}'s id {public}"


def test_each_surface_answers_in_its_own_envelope():
    shapes = {Surface.NATIVE: RelayError, Surface.OPENAI: OpenAIError, Surface.ANTHROPIC: AnthropicError}
    for surface in registry.all_surfaces():
        err = surface.error(404, "", "No batch found.")
        assert type(err) is shapes[surface.name]
        # A shared parser's error (the relay's envelope) is re-shaped into the surface's own.
        assert type(surface.envelope(RelayError(400, "invalid_json", "bad body"))) is shapes[surface.name]


def test_webhook_events_are_the_surfaces_own():
    emitted = {t for surface in registry.all_surfaces() for t in surface.events.values()}
    assert emitted == set(events.EVENT_TYPES)
    for event_type in events.EVENT_TYPES:
        owners = [s.name for s in registry.all_surfaces() if event_type in s.sample_events]
        assert len(owners) == 1, f"{event_type}: the test event's surface is {owners}"
    pk = uuid.uuid4()
    assert events.data(Surface.ANTHROPIC, pk) == {"id": f"msgbatch_{pk.hex}", "processing_status": "ended"}
    assert events.data(Surface.OPENAI, pk) == {"id": f"batch_{pk.hex}"}
    assert events.event_type(Surface.NATIVE, BatchStatus.FAILED) is None
    assert events.waits_for_batch(Surface.NATIVE, BatchStatus.CANCELLED)
    assert not events.waits_for_batch(Surface.OPENAI, BatchStatus.CANCELLED)


def _surface_branches(tree) -> list[int]:
    """Lines that compare with a surface's name or index a table by one (`x == Surface.OPENAI`, `T[Surface.NATIVE]`)."""

    def names_surface(node) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "Surface"
            and node.attr in Surface.names
            or isinstance(node, ast.Constant)
            and node.value in Surface.values
        )

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(names_surface(n) for n in [node.left, *node.comparators]):
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and names_surface(node.slice):
            lines.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(k is not None and names_surface(k) for k in node.keys):
            lines.append(node.lineno)
        elif isinstance(node, ast.keyword) and node.arg == "surface" and names_surface(node.value):
            lines.append(node.value.lineno)
    return lines


def test_the_modules_that_serve_every_surface_do_not_branch_on_one():
    offenders = []
    for rel, functions in SURFACE_BLIND.items():
        tree = ast.parse((ROOT / rel).read_text())
        if functions is not None:
            found = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in functions}
            assert set(found) == functions, f"{rel}: {sorted(functions - set(found))} gone: update this test"
            tree = ast.Module(body=list(found.values()), type_ignores=[])
        offenders += [f"{rel}:{line}" for line in _surface_branches(tree)]
    assert offenders == [], "surface branches outside the surface objects: " + ", ".join(offenders)


def test_a_surface_package_does_not_import_another():
    packages = [p.name for p in (ROOT / "batches" / "surfaces").iterdir() if (p / "surface.py").exists()]
    assert sorted(packages) == ["anthropic", "native", "openai"]
    offenders = []
    for package in packages:
        others = {f"batches.surfaces.{other}" for other in packages if other != package}
        for path in (ROOT / "batches" / "surfaces" / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    modules = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
                elif isinstance(node, ast.Import):
                    modules = {a.name for a in node.names}
                else:
                    continue
                if any(m == o or m.startswith(o + ".") for m in modules for o in others):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == [], "a surface imports another: " + ", ".join(offenders)


def test_the_edge_names_no_surface_route_and_imports_nothing_of_batches():
    """The edge answers on a surface's routes what the surface registered (gateway/edge.py `register_routes`)."""
    tree = ast.parse((ROOT / "gateway" / "edge.py").read_text())
    imports = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom | ast.Import)
        for alias in node.names
    ]
    assert not [m for m in imports if m and m.split(".")[0] == "batches"]
    paths = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("/")
    ]
    assert not [p for p in paths if "/batches" in p or "/files" in p], paths
