"""The batch surfaces: one package each, over the same rows and workers.

    native/      Relay-native: submit (spooled or streamed), progress and results (docs/api/native.md)
    openai/      OpenAI-compatible: create, validation, finalize, files, reads, serialize (docs/api/openai.md)
    anthropic/   Anthropic-compatible Message Batches: create, reads and results (docs/api/anthropic.md)
    common.py    what they share at their edges

What a surface means to the lifecycle (its expiry, its end once every item is final, how it is
cancelled) is its entry in `batches.lifecycle.stop.SURFACES`. A fourth surface is one more package
and one more entry there.
"""
