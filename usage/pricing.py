"""Cost of an event in integer nano-USD (1 USD = 1e9 nano-USD), never floats.

Rates are nano-USD per million tokens. Splitting the rate into a whole part
and a remainder (`count*q + count*r // 1e6`) gives the exact floor of
`count * rate / 1e6` for any size of count, and floors once per meter like the
product. An unpriced event has cost None, not 0: a null rate charged for real
tokens is unknown, and summaries count such events apart.
"""

from core.models import Pricing
from usage.tokens import Tokens

PER_MILLION = 1_000_000


def cost_nano_usd(pricing: "Pricing | None", tokens: Tokens) -> int | None:
    if pricing is None:
        return None
    if is_long_context(pricing, tokens):
        # Above the tier's threshold every token of the request is at the long rates (Anthropic's rule for
        # the 1M-context beta: "requests that exceed 200K input tokens are charged at premium rates").
        rates = (
            pricing.long_input_nanos_per_mtok,
            pricing.long_output_nanos_per_mtok,
            pricing.long_cache_read_nanos_per_mtok,
            pricing.long_cache_write_nanos_per_mtok,
        )
    else:
        rates = (
            pricing.input_nanos_per_mtok,
            pricing.output_nanos_per_mtok,
            pricing.cache_read_nanos_per_mtok,
            pricing.cache_write_nanos_per_mtok,
        )
    meters = zip((tokens.input, tokens.output, tokens.cache_read, tokens.cache_write), rates, strict=True)
    total = 0
    for count, rate in meters:
        if count == 0:
            # Nothing used on this meter: its rate, priced or not, does not matter.
            continue
        if rate is None:
            return None
        q, r = divmod(rate, PER_MILLION)
        total += count * q + (count * r) // PER_MILLION
    return total


def is_long_context(pricing: "Pricing", tokens: Tokens) -> bool:
    """Is this request above the pricing's long-context threshold? Counted on the input side (input, cache
    read and cache write tokens together), as the provider counts it."""
    threshold = getattr(pricing, "long_context_threshold_tokens", None)
    return threshold is not None and tokens.input + tokens.cache_read + tokens.cache_write > threshold


def discounted(cost_nano_usd: int, percent: int) -> int:
    """The price after a whole-percent discount, floored to the nano-USD (in the caller's favour)."""
    return cost_nano_usd * (100 - percent) // 100


def provider_batch_cost(pricing: "Pricing | None", tokens: Tokens) -> int | None:
    """What the provider charges for a record run through its batch API: the pricing's batch rates, and
    where one is not set, half the live rate (OpenAI's and Anthropic's batch price; cache rates too)."""
    if pricing is None:
        return None
    return cost_nano_usd(_BatchRates(pricing), tokens)


class _BatchRates:
    """A pricing seen at its batch rates (the meters `cost_nano_usd` reads, and its long-context tier)."""

    def __init__(self, pricing: "Pricing"):
        self.input_nanos_per_mtok = _batch_rate(pricing.batch_input_nanos_per_mtok, pricing.input_nanos_per_mtok)
        self.output_nanos_per_mtok = _batch_rate(pricing.batch_output_nanos_per_mtok, pricing.output_nanos_per_mtok)
        self.cache_read_nanos_per_mtok = _batch_rate(None, pricing.cache_read_nanos_per_mtok)
        self.cache_write_nanos_per_mtok = _batch_rate(None, pricing.cache_write_nanos_per_mtok)
        # The long-context tier at the batch price too: half its rates (Anthropic halves every rate in a batch).
        self.long_context_threshold_tokens = pricing.long_context_threshold_tokens
        self.long_input_nanos_per_mtok = _batch_rate(None, pricing.long_input_nanos_per_mtok)
        self.long_output_nanos_per_mtok = _batch_rate(None, pricing.long_output_nanos_per_mtok)
        self.long_cache_read_nanos_per_mtok = _batch_rate(None, pricing.long_cache_read_nanos_per_mtok)
        self.long_cache_write_nanos_per_mtok = _batch_rate(None, pricing.long_cache_write_nanos_per_mtok)


def _batch_rate(explicit: int | None, live: int | None) -> int | None:
    if explicit is not None:
        return explicit
    return None if live is None else live // 2
