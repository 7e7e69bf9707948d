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
    return Tokens(input=-(-prompt_chars // CHARS_PER_TOKEN), output=_output_limit(body))


def _output_limit(body) -> int:
    if isinstance(body, dict):
        for name in _OUTPUT_LIMITS:
            value = body.get(name)
            if _positive(value):
                return value
    return DEFAULT_MAX_OUTPUT


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# A spend budget's reservation must hold a bound, not an average (usage.budgets): `estimate`'s ~4 characters
# per token is English prose, while digits, code, short words and most non-Latin scripts run at one or two
# characters a token, so a prompt can cost two to four times its estimate, and with every slot of a worker
# fleet reserving at once those shortfalls add up. Every token of a byte-level BPE vocabulary (OpenAI's,
# Anthropic's) spells at least one byte of text, so a prompt has at most as many tokens as its UTF-8 bytes;
# the JSON around each message (~30 bytes) covers the few tokens a chat template adds to it. What the body
# does not spell out is not bounded this way: an image, audio or file given by reference, and a Responses
# call's `previous_response_id` conversation.
_CHOICES = ("n", "best_of")  # completions generated per request (OpenAI chat and completions; best_of >= n)


def worst_case(body: dict) -> Tokens:
    """The most tokens a request can be billed, before its call: input, the UTF-8 bytes of its body; output,
    its output limit (as `estimate` reads it) times the completions it asks for (`n`, `best_of`)."""
    try:
        size = len(json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass"))
    except (TypeError, ValueError):
        size = 0
    choices = 1
    if isinstance(body, dict):
        choices = max([body[name] for name in _CHOICES if _positive(body.get(name))], default=1)
    return Tokens(input=size, output=_output_limit(body) * choices)
