"""Token counts from an upstream answer, in the product's four meters.

Each API reports usage in its own shape, and they disagree on what "input"
means: OpenAI's prompt/input counts *include* cached tokens, Anthropic's
`input_tokens` does not. Everything here is normalised to the product's
meters, where each token is counted once: `input` is the uncached prompt,
`cache_read` and `cache_write` are the cache meters, and `output` already
includes reasoning tokens (every API counts them inside the completion).

A usage block we cannot read must never fail a request that has already
been answered, so anything malformed counts as zero.
"""

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Tokens:
    input: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0

    @property
    def total(self) -> int:
        return self.input + self.output + self.cache_read + self.cache_write


def parse_usage(adapter: str, path: str, body: dict) -> Tokens:
    """Tokens of one upstream answer. `adapter` picks the API family, `path` the endpoint within it."""
    usage = _dict(body, "usage")
    if adapter == "anthropic":
        return Tokens(
            input=_count(usage, "input_tokens"),
            output=_count(usage, "output_tokens"),
            cache_read=_count(usage, "cache_read_input_tokens"),
            cache_write=_count(usage, "cache_creation_input_tokens"),
        )
    endpoint = path.split("?", 1)[0].rstrip("/")
    if adapter == "openai_responses" or endpoint.endswith("/responses"):
        return _split_cached(
            _count(usage, "input_tokens"),
            _count(_dict(usage, "input_tokens_details"), "cached_tokens"),
            output=_count(usage, "output_tokens"),
        )
    if adapter == "openai":
        if endpoint.endswith("/embeddings"):
            return Tokens(input=_count(usage, "prompt_tokens"))
        return _split_cached(
            _count(usage, "prompt_tokens"),
            _count(_dict(usage, "prompt_tokens_details"), "cached_tokens"),
            output=_count(usage, "completion_tokens"),
        )
    return Tokens()


def _split_cached(prompt: int, cached: int, *, output: int) -> Tokens:
    # A cached count above the prompt it is part of is a broken upstream; cap it
    # so the total still equals what the provider says it billed.
    cached = min(cached, prompt)
    return Tokens(input=prompt - cached, output=output, cache_read=cached)


def _dict(obj, key: str) -> dict:
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, dict) else {}


def _count(obj: dict, key: str) -> int:
    value = obj.get(key)
    # bool is an int subclass, but `true` is no token count.
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return 0


# A request's worst case before its call, for what must be reserved ahead (a provider's token quota,
# a spend budget). Prompts are estimated from their size: ~4 characters per token is OpenAI's own rule
# of thumb for English, and counting the whole JSON body (keys and punctuation included) errs high,
# which is the side a reservation must err on. Output is what the request allows itself.
CHARS_PER_TOKEN = 4
# When a request names no output limit (OpenAI's are optional) the reservation assumes this many.
DEFAULT_MAX_OUTPUT = 4096
_OUTPUT_LIMITS = ("max_completion_tokens", "max_output_tokens", "max_tokens")


def estimate(body: dict, prompt_chars: int | None = None) -> Tokens:
    """Input and output tokens a request may use at most, before its call: the prompt from its size
    (`prompt_chars`, when the caller knows the body's serialized length, else measured here) and the
    output from `max_completion_tokens` / `max_output_tokens` / `max_tokens`."""
    if prompt_chars is None:
        try:
            prompt_chars = len(json.dumps(body, separators=(",", ":"), ensure_ascii=False))
        except (TypeError, ValueError):
            prompt_chars = 0
    output = DEFAULT_MAX_OUTPUT
    if isinstance(body, dict):
        for name in _OUTPUT_LIMITS:
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                output = value
                break
    return Tokens(input=-(-prompt_chars // CHARS_PER_TOKEN), output=output)
