"""The surfaces as the operator's tools see them: how each one's public id reads, and the object its
API shows for a batch. The admin searches every surface's ids through it and shows each batch as its
own API would; a new surface is one more entry. (What a surface means to the lifecycle — expiry, its
end, cancel — is `batches.lifecycle.stop.SURFACES`.)"""

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from batches.models import Batch, Surface
from batches.surfaces.anthropic import read as anthropic_read
from batches.surfaces.native import read as native_read
from batches.surfaces.openai import read as openai_read
from batches.surfaces.openai import serialize as openai_serialize


@dataclass(frozen=True)
class Shown:
    parse_id: Callable[[str], uuid.UUID | None]  # the id a client holds → the row's id (None: not this surface's)
    serialize: Callable[[Batch], dict]  # the object its API answers for the batch (a native one without items)


SURFACES = {
    Surface.NATIVE: Shown(parse_id=native_read.parse_native_id, serialize=native_read.status_head),
    Surface.OPENAI: Shown(
        parse_id=lambda text: openai_read.parse_public_id(text, "batch_"), serialize=openai_serialize.batch
    ),
    Surface.ANTHROPIC: Shown(
        parse_id=anthropic_read.parse_id,
        serialize=lambda batch: anthropic_read.serialize(batch, "/v1/messages/batches/"),
    ),
}
assert set(SURFACES) == set(Surface.values)


def find_id(text: str) -> uuid.UUID | None:
    """The row id behind any id a client of any surface holds."""
    for shown in SURFACES.values():
        pk = shown.parse_id(text.strip())
        if pk is not None:
            return pk
    return None


def as_shown(batch: Batch) -> dict:
    return SURFACES[batch.surface].serialize(batch)
