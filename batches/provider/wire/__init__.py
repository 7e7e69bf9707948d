"""The providers' batch APIs behind one registry: the seam a new provider plugs into.

    base.py        BatchAPI (the interface), Target, Status, Result, InputFile, the refusals   (gateway.adapters,
                   gateway.upstream)
    openai.py      OpenAI Files + Batches                                                       (base)
    anthropic.py   Anthropic Message Batches                                                    (base)
    __init__.py    REGISTRY: kind → class; `api()` and `for_adapter()`                          (the above)

The job code (jobs.py, placement.py, results.py) asks the registry for a job's API and calls its methods; it
never compares a kind. Adding a provider is one module here and one line in REGISTRY (the checklist:
docs/decisions/0018-provider-batch-apis.md). This package imports nothing from `batches`."""

from batches.provider.wire.anthropic import AnthropicBatchAPI
from batches.provider.wire.base import (
    FIND_WINDOW,
    BatchAPI,
    InputFile,
    LeaseLost,
    NotYetKnown,
    Refused,
    Result,
    Status,
    Target,
)
from batches.provider.wire.openai import OpenAIBatchAPI

__all__ = [
    "FIND_WINDOW",
    "REGISTRY",
    "AnthropicBatchAPI",
    "BatchAPI",
    "InputFile",
    "LeaseLost",
    "NotYetKnown",
    "OpenAIBatchAPI",
    "Refused",
    "Result",
    "Status",
    "Target",
    "api",
    "for_adapter",
]

# Each provider's batch API by its kind (the name a ProviderJob stores; its CHECK constraint lists these).
REGISTRY: dict[str, type[BatchAPI]] = {
    OpenAIBatchAPI.kind: OpenAIBatchAPI,
    AnthropicBatchAPI.kind: AnthropicBatchAPI,
}


def api(kind: str) -> type[BatchAPI]:
    """The batch API of a job's `kind` (KeyError: a kind no longer registered)."""
    return REGISTRY[kind]


def for_adapter(adapter: str) -> type[BatchAPI] | None:
    """The batch API that takes the records of a binding with `adapter`, if a registered one does (a binding
    adapter no API takes runs its records in the relay)."""
    for cls in REGISTRY.values():
        if adapter in cls.adapters:
            return cls
    return None
