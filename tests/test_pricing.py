"""Cost arithmetic: exact integer nano-USD, floored per meter; unpriced is None, never 0."""

from fractions import Fraction

import pytest

from core.models import Pricing
from usage.pricing import cost_nano_usd
from usage.tokens import Tokens


def pricing(input=None, output=None, cache_read=None, cache_write=None) -> Pricing:
    # Unsaved: the arithmetic needs no database.
    return Pricing(
        name="p",
        input_nanos_per_mtok=input,
        output_nanos_per_mtok=output,
        cache_read_nanos_per_mtok=cache_read,
        cache_write_nanos_per_mtok=cache_write,
    )


def exact(count: int, rate: int) -> int:
    return int(Fraction(count * rate, 1_000_000))  # floor, for non-negative values


def test_every_meter_at_its_own_rate():
    p = pricing(input=2_500_000_000, output=10_000_000_000, cache_read=1_250_000_000, cache_write=3_750_000_000)
    tokens = Tokens(input=1_000, output=500, cache_read=4_000, cache_write=2_000)
    # $2.50/Mtok × 1000 = 2_500_000 nanos; $10 × 500 = 5_000_000; $1.25 × 4000 = 5_000_000; $3.75 × 2000 = 7_500_000
    assert cost_nano_usd(p, tokens) == 20_000_000


def test_awkward_rate_is_exact_and_floored():
    p = pricing(input=2_500_000_001)
    # 3 × 2_500_000_001 / 1e6 = 7500.000003 → 7500
    assert cost_nano_usd(p, Tokens(input=3)) == 7500
    # 1_000_000 tokens hit the remainder exactly once.
    assert cost_nano_usd(p, Tokens(input=1_000_000)) == 2_500_000_001


def test_floor_is_per_meter_then_summed():
    p = pricing(input=1_500_000, output=1_500_000)
    # Each meter is 1.5 nanos → 1; flooring the sum instead would give 3.
    assert cost_nano_usd(p, Tokens(input=1, output=1)) == 2


def test_rate_below_one_nano_per_token():
    p = pricing(input=999_999)
    assert cost_nano_usd(p, Tokens(input=1)) == 0
    assert cost_nano_usd(p, Tokens(input=1_000_001)) == 999_999


@pytest.mark.parametrize(
    "count,rate",
    [
        (10**15, 2_500_000_001),
        (123_456_789_012_345_678, 2_500_000_001),
        (987_654_321_987_654_321, 75_000_000_000_003),
        (2**62 + 12345, 999_999),
    ],
)
def test_huge_counts_have_no_float_error(count, rate):
    cost = cost_nano_usd(pricing(output=rate), Tokens(output=count))
    assert isinstance(cost, int)
    assert cost == exact(count, rate)


def test_a_float_computation_would_have_been_wrong():
    count, rate = 123_456_789_012_345_678, 2_500_000_001
    assert int(count * rate / 1e6) == 308_641_972_654_320_975_872  # off by 8140 nanos
    assert cost_nano_usd(pricing(input=rate), Tokens(input=count)) == 308_641_972_654_320_984_012


def test_zero_tokens_cost_zero_when_priced():
    assert cost_nano_usd(pricing(input=1, output=1, cache_read=1, cache_write=1), Tokens()) == 0


def test_no_pricing_is_unpriced():
    assert cost_nano_usd(None, Tokens(input=10)) is None
    assert cost_nano_usd(None, Tokens()) is None


@pytest.mark.parametrize("meter", ["input", "output", "cache_read", "cache_write"])
def test_null_rate_with_tokens_is_unpriced_not_free(meter):
    rates = {m: 1_000_000 for m in ("input", "output", "cache_read", "cache_write")}
    rates[meter] = None
    assert cost_nano_usd(pricing(**rates), Tokens(**{meter: 1})) is None


def test_null_rate_with_zero_count_is_fine():
    # Like the catalog's gpt pricing: no cache-write rate, and no cache writes.
    p = pricing(input=2_500_000_000, output=10_000_000_000, cache_read=1_250_000_000)
    assert cost_nano_usd(p, Tokens(input=100, output=10, cache_read=1000)) == 250_000 + 100_000 + 1_250_000


def test_zero_rate_is_priced_and_free():
    assert cost_nano_usd(pricing(input=0, output=0), Tokens(input=10, output=10)) == 0
