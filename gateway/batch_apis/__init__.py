"""The providers' batch APIs behind one registry: the seam a new provider plugs into.

    base.py        BatchAPI (the interface), Target, Status, Result, InputFile, the refusals   (gateway.adapters,
                   gateway.upstream)
    openai.py      OpenAI Files + Batches; the same on an OpenAI-compatible server              (base)
    anthropic.py   Anthropic Message Batches                                                    (base)
    azure.py       Azure OpenAI Global Batch (OpenAI's wire under /openai/v1, api-key)          (openai)
    bedrock.py     Amazon Bedrock batch inference (S3 in and out, SigV4)                        (base)
    __init__.py    REGISTRY: kind → class; `api()` and `for_host()`                             (the above)

A host's kind names its batch API (`core.hostkinds…batch_api`, None: it has none); the job code (jobs.py,
placement.py, results.py) asks the registry for that API and calls its methods; it never compares a kind.
Adding a provider is one module here and one line in REGISTRY (the checklist:
docs/decisions/0018-provider-batch-apis.md). This package imports nothing from `batches`."""

from core import hostkinds
from gateway.batch_apis.anthropic import AnthropicBatchAPI
from gateway.batch_apis.azure import AzureBatchAPI
from gateway.batch_apis.base import (
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
from gateway.batch_apis.bedrock import BedrockBatchAPI
from gateway.batch_apis.openai import OpenAIBatchAPI, OpenAICompatibleBatchAPI
from gateway.batch_apis.vertex import VertexBatchAPI

__all__ = [
    "FIND_WINDOW",
    "REGISTRY",
    "AnthropicBatchAPI",
    "AzureBatchAPI",
    "BatchAPI",
    "BedrockBatchAPI",
    "InputFile",
    "LeaseLost",
    "NotYetKnown",
    "OpenAIBatchAPI",
    "OpenAICompatibleBatchAPI",
    "Refused",
    "Result",
    "Status",
    "Target",
    "api",
    "for_host",
]

# Each provider's batch API by its kind (the name a ProviderJob stores; its CHECK constraint lists these).
REGISTRY: dict[str, type[BatchAPI]] = {
    OpenAIBatchAPI.kind: OpenAIBatchAPI,
    AnthropicBatchAPI.kind: AnthropicBatchAPI,
    AzureBatchAPI.kind: AzureBatchAPI,
    BedrockBatchAPI.kind: BedrockBatchAPI,
    OpenAICompatibleBatchAPI.kind: OpenAICompatibleBatchAPI,
    VertexBatchAPI.kind: VertexBatchAPI,
}


def api(kind: str) -> type[BatchAPI]:
    """The batch API of a job's `kind` (KeyError: a kind no longer registered)."""
    return REGISTRY[kind]


def for_host(host, adapter: str) -> type[BatchAPI] | None:
    """The batch API that takes the records of a binding with `adapter` on `host`: the one its host's kind
    names, if that API takes the adapter's shape. None: the host's kind has no batch API the relay speaks
    (Gemini's takes only its own request shape), and its batch records run in the relay."""
    name = hostkinds.of(host, adapter).batch_api
    cls = REGISTRY.get(name) if name else None
    return cls if cls is not None and adapter in cls.adapters else None
