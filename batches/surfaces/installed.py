"""The batch surfaces this relay serves: a new surface is its package and one line here
(docs/decisions/0019-surface-objects.md). Installed by the batches app's ready(), before any request or task."""

from batches.surfaces import registry
from batches.surfaces.anthropic.surface import AnthropicSurface
from batches.surfaces.native.surface import NativeSurface
from batches.surfaces.openai.surface import OpenAISurface
from gateway import edge

SURFACES = (
    NativeSurface(),
    OpenAISurface(),
    AnthropicSurface(),
)


def install() -> None:
    for surface in SURFACES:
        registry.register(surface)
        edge.register_routes(surface)  # what the edge answers on its routes before a view runs
    registry.check_complete()
