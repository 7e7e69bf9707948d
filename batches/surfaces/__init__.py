"""The batch surfaces: one package each, over the same rows and workers.

    native/      Relay-native: submit (spooled or streamed), progress and results (docs/api/native.md)
    openai/      OpenAI-compatible: create, validation, finalize, files, reads, serialize (docs/api/openai.md)
    anthropic/   Anthropic-compatible Message Batches: create, reads and results (docs/api/anthropic.md)
    common.py    what they share at their edges
    registry.py  the `BatchSurface` base class and the registry: a leaf the lifecycle reads
    installed.py the surfaces this relay serves, installed by the batches app's ready()
    retry.py     re-run what failed, for any surface

Each package's `surface.py` is the surface as one object: its ids, envelope, create, answers, lifecycle
rules, retry rules and webhook events (docs/decisions/0019-surface-objects.md). A fourth surface is one
more package and one more line in installed.py.
"""
