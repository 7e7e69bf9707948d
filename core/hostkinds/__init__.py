"""Host kinds behind one registry: how each host is reached.

    base.py              HostKind (the interface), Option, the endpoint sets           (nothing of the relay)
    openai.py            openai, openai_compatible                                      (base)
    anthropic.py         anthropic                                                      (base)
    azure_openai.py      azure_openai                                                   (base)
    gemini.py            gemini                                                         (base)
    bedrock.py           bedrock                                                        (base)
    vertex.py            vertex                                                         (base, anthropic)
    __init__.py          REGISTRY: name → kind; `get()`, `of()`                          (the above)

Callers (gateway.adapters, the pipeline through it, `relay apply`, the admin) ask the kind; none compares a kind's
name. Adding a provider is one module here and one line in REGISTRY (then `makemigrations relay`: `Host.kind`'s
choices and CHECK constraint list the registry). A host whose `kind` is empty is reached as before kinds existed:
each binding's adapter picks OpenAI's or Anthropic's wire (`NATIVE`), so catalogs written before keep working."""

from core.hostkinds.anthropic import AnthropicKind
from core.hostkinds.azure_openai import AzureOpenAIKind
from core.hostkinds.base import HostKind, Option, env_problem
from core.hostkinds.bedrock import BedrockKind
from core.hostkinds.gemini import GeminiKind
from core.hostkinds.openai import OpenAICompatibleKind, OpenAIKind
from core.hostkinds.vertex import VertexKind

__all__ = ["NATIVE", "REGISTRY", "HostKind", "Option", "choices", "env_problem", "get", "of"]

REGISTRY: dict[str, HostKind] = {
    kind.name: kind
    for kind in (
        OpenAIKind(),
        AnthropicKind(),
        OpenAICompatibleKind(),
        AzureOpenAIKind(),
        GeminiKind(),
        BedrockKind(),
        VertexKind(),
    )
}

# A host without a kind: the kind its binding's adapter names (the two wires the relay spoke before kinds).
NATIVE = {"openai": "openai", "openai_responses": "openai", "anthropic": "anthropic"}


def get(name: str) -> HostKind:
    """The kind called `name` (KeyError: not a registered kind)."""
    return REGISTRY[name]


def of(host, adapter: str) -> HostKind:
    """The kind that reaches `host` for a binding with `adapter`."""
    return REGISTRY[host.kind or NATIVE[adapter]]


def choices() -> list[tuple[str, str]]:
    return [("", "(from each binding's adapter: openai or anthropic)")] + [(k.name, k.label) for k in REGISTRY.values()]
