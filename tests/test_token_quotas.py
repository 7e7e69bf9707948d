"""Token quotas as well as requests: the providers' token headers learned per host key, each call's
worst case (usage.tokens.estimate) reserved in the key pick, the unused part given back after it.

The pick and settle against a real Redis; then a batch drained by real worker processes against a
fake provider that limits tokens per window and answers 429 beyond it (bench.capacity)."""

import io
import json
import time
from dataclasses import dataclass

import pytest

from batches import ingest
from batches.models import Batch, Item
from batches.surfaces.openai import create as openai_create
from bench.capacity import TokenLimitedUpstream, start
from core import auth
from core.redis import get_redis
from policies import keypool, provider_limits
from policies.models import PolicyHostKey
from tests.workers import wait_for
from usage.tokens import Tokens

CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Cand:
    key: object
    key_hash: str


def openai_headers(remaining: int, limit: int = 1000, reset: str = "60s") -> dict:
    return {
        "x-ratelimit-limit-tokens": str(limit),
        "x-ratelimit-remaining-tokens": str(remaining),
        "x-ratelimit-reset-tokens": reset,
    }


# --- the headers ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_openai_and_anthropic_token_headers_are_read():
    assert provider_limits.quota_from(openai_headers(700, 1000, "6m0s"), "tokens") == (700, 360.0, 1000)
    anthropic = {
        "anthropic-ratelimit-tokens-limit": "80000",
        "anthropic-ratelimit-tokens-remaining": "79000",
        "anthropic-ratelimit-tokens-reset": "2099-01-01T00:00:00Z",
        "anthropic-ratelimit-input-tokens-limit": "40000",
        "anthropic-ratelimit-input-tokens-remaining": "39500",
        "anthropic-ratelimit-input-tokens-reset": "2099-01-01T00:00:00Z",
        "Anthropic-RateLimit-Output-Tokens-Limit": "8000",
        "anthropic-ratelimit-output-tokens-remaining": "7500",
        "anthropic-ratelimit-output-tokens-reset": "2099-01-01T00:00:00Z",
    }
    assert provider_limits.quota_from(anthropic, "tokens")[0::2] == (79000, 80000)
    assert provider_limits.quota_from(anthropic, "input_tokens")[0::2] == (39500, 40000)
    assert provider_limits.quota_from(anthropic, "output_tokens")[0::2] == (7500, 8000)
    assert provider_limits.quota_from(anthropic, "requests") is None
    assert provider_limits.quota_from({"x-ratelimit-remaining-tokens": "x1"}, "tokens") is None
    assert provider_limits.settle_args({}) is None  # nothing said, nothing held: no round trip


# --- reserve in the pick, settle after the call ---------------------------------------------------


@pytest.fixture
def pool(catalog):
    keys = [k for k in catalog.keys if k.host.name == "openai"]
    return catalog.policy, [Cand(k, f"h{i}") for i, k in enumerate(keys)]


def left(key_hash: str, meter: str = "tokens") -> int:
    return int(get_redis().get(f"relay:quota:{{{key_hash}}}:{meter}"))


def first(picks):
    cand, _ = next(iter(picks))
    return cand.key.name, picks.held


@pytest.mark.django_db
def test_the_estimate_is_reserved_and_a_key_it_does_not_fit_is_skipped_until_reset(pool):
    policy, cands = pool
    provider_limits.learn("h0", openai_headers(500, reset="60s"))
    need = Tokens(input=100, output=300)
    assert first(keypool.pick(policy, cands, max_picks=1, need=need)) == ("openai-0", provider_limits.Held(400, 0, 0))
    assert left("h0") == 100
    # 400 more do not fit into the 100 left: the next key, which the provider said nothing about.
    assert first(keypool.pick(policy, cands, max_picks=1, need=need)) == ("openai-1", provider_limits.NOTHING_HELD)
    # Every key spent: the wait is the window's reset.
    for h in ("h1", "h2"):
        provider_limits.learn(h, openai_headers(0, reset="30s"))
    picks = keypool.pick(policy, cands, max_picks=3, need=need)
    assert list(picks) == [] and 25_000 < picks.retry_after_ms <= 30_000


@pytest.mark.django_db
def test_the_unused_part_goes_back_and_the_provider_lower_word_wins(pool):
    policy, cands = pool
    provider_limits.learn("h0", openai_headers(1000, reset="60s"))
    picks = keypool.pick(policy, cands[:1], max_picks=1, need=Tokens(input=100, output=300))
    _, held = first(picks)
    assert left("h0") == 600
    # The call used 150: 250 go back; the provider, not counting our other calls in flight, says 850.
    provider_limits.settle("h0", openai_headers(850), held, Tokens(input=100, output=50))
    assert left("h0") == 850
    # Here the provider says less than we count (another client of the key): its word wins.
    picks = keypool.pick(policy, cands[:1], max_picks=1, need=Tokens(input=100, output=300))
    _, held = first(picks)
    provider_limits.settle("h0", openai_headers(200), held, Tokens(input=100, output=300))
    assert left("h0") == 200
    # A call that broke after sending gives nothing back: the provider may have counted it all.
    provider_limits.settle("h0", {}, provider_limits.Held(100), None)
    assert left("h0") == 200


@pytest.mark.django_db
def test_the_success_settle_gives_back_in_the_same_round_trip(pool):
    policy, cands = pool
    provider_limits.learn("h0", openai_headers(1000, reset="60s"))
    picks = keypool.pick(policy, cands[:1], max_picks=1, need=Tokens(input=100, output=300))
    _, tier = next(iter(picks))
    used = Tokens(input=100, output=20)
    keypool.settle_success(
        "h0", (tier, picks.inbound), quota=provider_limits.settle_args({}, picks.held, used), input_tokens=100
    )
    assert left("h0") == 880


@pytest.mark.django_db
def test_anthropic_input_and_output_quotas_are_reserved_apart(pool):
    policy, cands = pool
    reset = "2099-01-01T00:00:00Z"
    provider_limits.learn(
        "h0",
        {
            "anthropic-ratelimit-input-tokens-limit": "1000",
            "anthropic-ratelimit-input-tokens-remaining": "1000",
            "anthropic-ratelimit-input-tokens-reset": reset,
            "anthropic-ratelimit-output-tokens-limit": "500",
            "anthropic-ratelimit-output-tokens-remaining": "500",
            "anthropic-ratelimit-output-tokens-reset": reset,
        },
    )
    need = Tokens(input=100, output=300)
    assert first(keypool.pick(policy, cands, max_picks=1, need=need)) == ("openai-0", provider_limits.Held(0, 100, 300))
    assert (left("h0", "input_tokens"), left("h0", "output_tokens")) == (900, 200)
    # The output quota is the one that no longer fits.
    assert first(keypool.pick(policy, cands, max_picks=1, need=need))[0] == "openai-1"


@pytest.mark.django_db
def test_a_request_larger_than_the_whole_window_waits_for_a_fresh_one_not_forever(pool):
    policy, cands = pool
    provider_limits.learn("h0", openai_headers(1000, limit=1000, reset="60s"))
    need = Tokens(input=100, output=5000)
    assert first(keypool.pick(policy, cands[:1], max_picks=1, need=need))[1] == provider_limits.Held(1000)
    get_redis().delete("relay:quota:{h0}:tokens")  # the window reset
    assert first(keypool.pick(policy, cands[:1], max_picks=1, need=need))[1] == provider_limits.Held(1000)


# --- end to end: a batch against a provider limiting tokens per window ----------------------------


def token_batch(catalog, n: int) -> Batch:
    principal = auth.principal_for_key(catalog.key)
    records = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": CHAT,
            "body": {"model": "gpt-4o", "max_tokens": 200, "messages": [{"role": "user", "content": f"tell {i}"}]},
        }
        for i in range(n)
    ]
    body = {"endpoint": CHAT, "completion_window": "24h", "requests": records}
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**8, 50_000) as submission:
        return openai_create.create(principal, submission)


@pytest.mark.django_db(transaction=True)
def test_a_batch_against_a_token_limited_provider_is_paced_not_refused(worker, catalog):
    """One key, 3,000 tokens per 1 s window; each record counts 202 tokens at its start (prompt plus
    max_tokens) and uses 102. Almost no call is answered 429 and every record completes.

    120 records are some 8 windows of the limit, long past the first. The 429s are bounded in number (the
    1% of 240 calls this test once allowed), not as a share, so fewer records do not loosen the bound. The
    shared fleet drains it: the provider is the catalog's host, which the workers read from the database."""
    provider = start(TokenLimitedUpstream(limit_tokens=3000, window=1.0, delay=0.02))
    try:
        host = catalog.hosts["openai"]
        host.base_url = provider.url
        host.save()
        PolicyHostKey.objects.filter(policy=catalog.policy).exclude(host_key=catalog.keys[0]).delete()
        w = worker
        n = 120
        batch = token_batch(catalog, n)
        started = time.monotonic()
        wait_for(
            lambda: Batch.objects.get(pk=batch.pk).status in ("completed", "failed", "expired"),
            300,
            what="the batch",
        )
        elapsed = time.monotonic() - started
        assert w.alive(), w.output()
        assert set(Item.objects.filter(batch_id=batch.pk).values_list("state", flat=True)) == {"completed"}
        stats = provider.stats
        calls = stats["ok"] + stats["limited"]
        print(
            f"\n{n} records in {elapsed:.1f} s; {stats['tokens']} tokens served against 3000/s "
            f"({stats['tokens'] / elapsed / 3000:.0%}); 429s: {stats['limited']} of {calls}"
        )
        assert stats["ok"] == n
        assert stats["limited"] <= 2, stats
    finally:
        provider.shutdown()
        provider.server_close()
