"""The benchmarks' catalog (seeded through the ORM) and the chat requests they send."""

import json

# --- the catalog -----------------------------------------------------------------------------------


UPSTREAM_KEY = "bench-upstream-key"
MODEL = "gpt-4o"
UPSTREAM_MODEL = "gpt-4o-2024-08-06"
# The rate-limited provider: its own host and model, two keys the fake upstream limits per key.
RL_MODEL = "gpt-4o-rl"
RL_KEYS = ("sk-bench-rl-a", "sk-bench-rl-b")


def seed_catalog(upstream_url: str) -> str:
    """One team/project/service account, the openai host on the fake upstream, a priced binding,
    one host key, and a policy with a rate limit on every meter, set far above what a run can
    spend (so it is evaluated on every call but never trips). Returns the relay key (plaintext)."""
    from core.models import Host, HostBinding, HostKey, LLMModel, Pricing, Project, ServiceAccount, Team
    from core.services import create_relay_key
    from policies.models import Policy, PolicyHostKey, RateLimit, RateLimitRule

    team = Team.objects.create(name="bench")
    project = Project.objects.create(name="bench", team=team)
    sa = ServiceAccount.objects.create(project=project, name="bench")
    host = Host.objects.create(name="openai", base_url=upstream_url)
    price = Pricing.objects.create(
        name="gpt-4o",
        input_nanos_per_mtok=2_500_000_000,
        output_nanos_per_mtok=10_000_000_000,
        cache_read_nanos_per_mtok=1_250_000_000,
    )
    model = LLMModel.objects.create(name=MODEL, provider="openai")
    HostBinding.objects.create(model=model, host=host, adapter="openai", upstream_name=UPSTREAM_MODEL, pricing=price)
    key = HostKey(name="openai-bench", host=host)
    key.set_value(UPSTREAM_KEY)
    key.save()
    rl = RateLimit.objects.create(name="bench-inbound")
    for meter, amount, window, strategy in (
        ("requests", 1_000_000_000, 60, "sliding-window"),
        ("tokens", 1_000_000_000_000, 60, "sliding-window"),
        ("concurrency", 100_000, 60, "fixed-window"),
    ):
        RateLimitRule.objects.create(
            rate_limit=rl, meter=meter, amount=amount, window_seconds=window, strategy=strategy
        )
    policy = Policy.objects.create(name="bench", project=project, grants=["*"], rate_limit=rl)
    PolicyHostKey.objects.create(policy=policy, host_key=key, position=0)
    # The rate-limited provider (bench/fake_upstream.py limits keys named sk-bench-rl-*).
    rl_host = Host.objects.create(name="openai-rl", base_url=upstream_url)
    rl_model = LLMModel.objects.create(name=RL_MODEL, provider="openai")
    HostBinding.objects.create(
        model=rl_model, host=rl_host, adapter="openai", upstream_name=UPSTREAM_MODEL, pricing=price
    )
    for i, value in enumerate(RL_KEYS):
        rl_key = HostKey(name=f"openai-rl-{i}", host=rl_host)
        rl_key.set_value(value)
        rl_key.save()
        PolicyHostKey.objects.create(policy=policy, host_key=rl_key, position=1 + i)
    sa.policy = policy
    sa.save()
    _, plaintext = create_relay_key(service_account=sa, name="bench")
    return plaintext


def add_batch_binding(name: str, batch_mode: str) -> None:
    """A model `name` bound like gpt-4o (host openai on the fake upstream, same upstream model and pricing) whose
    batch records run where `batch_mode` says (relay | provider | auto: batches/provider/placement.py). The
    policy grants `*`, so the relay key of `seed_catalog` may use it."""
    from core.models import HostBinding, LLMModel

    source = HostBinding.objects.select_related("host", "pricing").get(model__name=MODEL)
    model = LLMModel.objects.create(name=name, provider="openai")
    HostBinding.objects.create(
        model=model,
        host=source.host,
        adapter=source.adapter,
        upstream_name=source.upstream_name,
        pricing=source.pricing,
        batch_mode=batch_mode,
    )


# --- request bodies --------------------------------------------------------------------------------

_WORDS = (
    "summarise the following support ticket in two sentences and list any product names mentioned "
    "the customer reports that the export job stalls after the nightly sync and asks for a workaround"
).split()


def chat_body(i: int, size: int = 0, model: str = MODEL) -> dict:
    """A realistic chat request; with `size`, padded so its compact JSON is about `size` bytes."""
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": "You are a careful assistant. Answer briefly."},
            {"role": "user", "content": f"Ticket {i}: "},
        ],
        "max_tokens": 256,
        "temperature": 0.2,
    }
    if size:
        missing = size - len(json.dumps(body, separators=(",", ":")))
        words, n, k = [], 0, i
        while n < missing:
            w = _WORDS[k % len(_WORDS)]
            words.append(w)
            n += len(w) + 1
            k += 1
        body["messages"][1]["content"] += " ".join(words)[: max(0, missing)]
    return body
