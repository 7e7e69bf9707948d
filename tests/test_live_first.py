"""Live first: while live traffic is active on a shared limit, batch items take at most the policy's
batch_share of it; with live quiet they take all of it; they back off when live meets a limit.

The key pick against a real Redis (each limit a batch and live traffic share: a host key's tier, the
provider's learned quota, the policy's rate limit), then live requests and batch calls through the
pipeline at once against a fake provider that allows N requests per window."""

import math
import threading
import time
import uuid
from dataclasses import dataclass
from decimal import Decimal

import pytest
from django.db import connection

from core import auth
from core.redis import get_redis
from gateway import pipeline
from policies import breaker, keypool, livefirst, provider_limits, ratelimit
from policies.models import Policy, PolicyHostKey
from tests import factories

CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Cand:
    key: object
    key_hash: str


@pytest.fixture
def one_key(catalog):
    key = catalog.keys[0]
    return catalog.policy, [Cand(key, "h0")]


def takes(policy, cands, source: str, most: int = 50) -> int:
    """How many picks of `source` succeed in a row (each one request)."""
    n = 0
    for _ in range(most):
        try:
            picks = keypool.pick(policy, cands, max_picks=1, source=source)
        except ratelimit.RateLimited:
            return n
        if not list(picks):
            return n
        n += 1
    return n


def tier(policy, cands, rule):
    cands[0].key.rate_limit = factories.rate_limit("tier", rule)


def live_now(scope: str, per_minute: float = 0.0) -> None:
    """Live traffic active on `scope` at this moment, at `per_minute` requests a minute for the last
    10 s (written as the pick keeps it, so the counts below do not depend on when the test runs)."""
    sec, usec = get_redis().time()
    now = sec * 1000 + usec // 1000
    window = livefirst.RATE_WINDOW_MS
    count = per_minute * window / 60_000  # live requests in the last window
    elapsed = now % window
    get_redis().hset(
        livefirst.mark_key(scope),
        mapping={"seen": now, "since": now - window, "idx": now // window, "cur": count * elapsed / window,
                 "prev": count, "tcur": 0, "tprev": 0},
    )  # fmt: skip


def learned(limit: int = 10, reset: str = "60s") -> None:
    provider_limits.learn(
        "h0",
        {
            "x-ratelimit-limit-requests": str(limit),
            "x-ratelimit-remaining-requests": str(limit),
            "x-ratelimit-reset-requests": reset,
        },
    )


def limited(policy, cands, limit: str) -> str:
    """The one shared limit of 10 requests a minute; returns the live mark's scope it is judged by."""
    if limit == "tier":
        tier(policy, cands, ("requests", 10, 60, "sliding-window"))
    elif limit == "learned":
        learned()
    else:
        policy.rate_limit = factories.rate_limit("inbound", ("requests", 10, 60, "sliding-window"))
        return f"policy:{policy.id}"
    return "h0"


@pytest.mark.django_db
@pytest.mark.parametrize("limit", ["tier", "learned", "policy"])
def test_with_live_active_a_batch_takes_at_most_its_share_and_live_still_finds_room(one_key, limit):
    policy, cands = one_key
    assert policy.batch_share == Decimal("0.80")
    live_now(limited(policy, cands, limit))
    assert takes(policy, cands, "batch") == 8  # 2 of 10 stay for live
    assert takes(policy, cands, "live") == 2


@pytest.mark.django_db
@pytest.mark.parametrize("limit", ["tier", "learned", "policy"])
def test_with_live_quiet_a_batch_takes_the_whole_limit(one_key, limit):
    policy, cands = one_key
    limited(policy, cands, limit)
    assert takes(policy, cands, "batch") == 10


@pytest.mark.django_db
def test_a_batch_leaves_what_busy_live_traffic_will_need_for_the_rest_of_the_window(one_key):
    """The provider's window: 100 requests a minute. Live traffic comes at 40 a minute, more than the
    20 its share keeps: the batch takes the 60 live leaves, and live then finds its 40."""
    policy, cands = one_key
    started = time.monotonic()
    learned(limit=100)
    live_now("h0", per_minute=40)
    took = takes(policy, cands, "batch", most=100)
    found = takes(policy, cands, "live", most=100)
    # Exact on a quiet machine (60 and 40). Time moves both figures: the provider's window refills at 100 a
    # minute and what live needs for the rest of it shrinks at 40 a minute, so a slow machine may see a few more
    # for the batch, never more than that time allows.
    slack = math.ceil((time.monotonic() - started) * (100 + 40) / 60)
    assert 60 <= took <= 60 + slack
    assert 40 - slack <= found and took + found <= 100 + slack


@pytest.mark.django_db
def test_live_is_quiet_once_no_live_request_came_for_a_window(one_key):
    policy, cands = one_key
    tier(policy, cands, ("requests", 10, 60, "fixed-window"))
    assert takes(policy, cands, "live", most=1) == 1  # a live pick marks the key
    assert get_redis().hget(livefirst.mark_key("h0"), "seen")
    # As if that live request were 61 s ago: older than the rule's 60 s window.
    get_redis().hincrby(livefirst.mark_key("h0"), "seen", -61_000)
    assert takes(policy, cands, "batch") == 9


@pytest.mark.django_db
def test_the_share_is_the_policys_and_zero_keeps_a_busy_key_for_live(one_key):
    policy, cands = one_key
    tier(policy, cands, ("requests", 10, 60, "sliding-window"))
    policy.batch_share = Decimal("0.50")
    live_now("h0")
    assert takes(policy, cands, "batch") == 5
    policy.batch_share = Decimal("0")
    assert takes(policy, cands, "batch") == 0
    assert takes(policy, cands, "live") == 5


@pytest.mark.django_db
def test_a_continuously_refilled_limit_keeps_live_s_part_usable(one_key):
    """A token bucket refills continuously: what the batch leaves stays in the bucket for live."""
    policy, cands = one_key
    tier(policy, cands, ("requests", 10, 60, "token-bucket"))
    live_now("h0")
    assert takes(policy, cands, "batch") == 8
    assert takes(policy, cands, "live") == 2


@pytest.mark.django_db
def test_when_live_meets_a_limit_batch_work_backs_off(one_key):
    policy, cands = one_key
    tier(policy, cands, ("requests", 3, 60, "fixed-window"))
    assert takes(policy, cands, "live") == 3  # live spent the key, and met its limit
    assert get_redis().pttl(livefirst.denied_key("h0")) > 0
    # The window rolls over (its count is dropped): the batch still stays off for a moment.
    for key in get_redis().scan_iter("relay:rl:{hostkey:*"):
        get_redis().delete(key)
    picks = keypool.pick(policy, cands, max_picks=1, source="batch")
    assert list(picks) == [] and 0 < picks.retry_after_ms <= livefirst.DENIED_MAX_MS
    assert takes(policy, cands, "live", most=1) == 1  # live is never held off


@pytest.mark.django_db
def test_when_live_meets_the_policys_limit_batch_picks_are_held(one_key):
    policy, cands = one_key
    policy.rate_limit = factories.rate_limit("inbound", ("requests", 2, 60, "fixed-window"))
    assert takes(policy, cands, "live") == 2
    with pytest.raises(ratelimit.RateLimited) as info:
        keypool.pick(policy, cands, max_picks=1, source="batch")
    assert "held for live traffic" in info.value.subject


@pytest.mark.django_db
def test_a_batch_calls_429_benches_the_key_for_batch_items_only(one_key):
    policy, cands = one_key
    livefirst.after_429("h0", "batch", 30)
    assert breaker.snapshot("h0")["state"] == "closed"
    picks = keypool.pick(policy, cands, max_picks=1, source="batch")
    assert list(picks) == [] and 25_000 < picks.retry_after_ms <= 30_000
    assert takes(policy, cands, "live", most=1) == 1


# --- end to end: live requests and a batch at once, through the pipeline --------------------------


def dispatch(principal, source: str, content: str) -> pipeline.Outcome:
    call = pipeline.Call(
        path=CHAT,
        body={"model": "gpt-4o", "messages": [{"role": "user", "content": content}]},
        principal=principal,
        source=source,
        request_id=str(uuid.uuid4()),
        deadline=time.monotonic() + 30,
    )
    return pipeline.dispatch(call)


@pytest.mark.django_db(transaction=True)
def test_live_requests_are_not_denied_while_a_batch_drains_on_the_same_key(catalog, fake):
    """One key, 20 requests per 2 s window, learned from the provider's headers; batch_share 0.5.
    Live sends about 5 requests per window; four batch slots take every request they may."""
    PolicyHostKey.objects.filter(policy=catalog.policy).exclude(host_key=catalog.keys[0]).delete()
    Policy.objects.filter(pk=catalog.policy.pk).update(batch_share=Decimal("0.50"))
    fake.limit_rate(20, window=2.0)
    principal = auth.principal_for_key(catalog.key)
    assert dispatch(principal, "live", "warm").status == 200  # the relay learns the quota
    stop = threading.Event()
    batch_ok, batch_waits = [], []

    def batch_slot():
        try:
            while not stop.is_set():
                outcome = dispatch(principal, "batch", "batch record")
                if outcome.ok:
                    batch_ok.append(1)
                else:
                    batch_waits.append(outcome.status)
                    stop.wait(min(outcome.retry_after or 0.05, 0.5))
        finally:
            connection.close()

    slots = [threading.Thread(target=batch_slot) for _ in range(4)]
    for t in slots:
        t.start()
    live = []
    try:
        for i in range(15):
            live.append(dispatch(principal, "live", f"live {i}").status)
            time.sleep(0.4)
    finally:
        stop.set()
        for t in slots:
            t.join()
    print(f"\nlive: {live}; batch: {len(batch_ok)} served, {len(batch_waits)} waits; provider: {fake.rate_stats}")
    assert live == [200] * 15
    assert batch_ok  # the batch drained what live left
    # Nobody learned the limit from a 429: the batch was paced by what the provider said.
    assert fake.rate_stats["limited"] <= 1, fake.rate_stats
