"""Builders for test data, going through the same services the product uses."""

from dataclasses import dataclass

from core.models import Host, HostBinding, HostKey, LLMModel, Pricing, Project, ServiceAccount, Team, User
from core.services import create_relay_key
from policies.models import Policy, PolicyHostKey, RateLimit, RateLimitRule


@dataclass
class Catalog:
    team: Team
    project: Project
    sa: ServiceAccount
    policy: Policy
    hosts: dict
    keys: list
    key: str  # plaintext relay key of the service account
    key_obj: object


def make_catalog(upstream_url: str, *, n_keys: int = 3, grants=("*",)) -> Catalog:
    team = Team.objects.create(name="team-a")
    project = Project.objects.create(name="proj-a", team=team)
    sa = ServiceAccount.objects.create(project=project, name="sa-a")
    openai = Host.objects.create(name="openai", base_url=upstream_url)
    anthropic = Host.objects.create(name="anthropic", base_url=upstream_url)
    price = Pricing.objects.create(
        name="p-gpt",
        input_nanos_per_mtok=2_500_000_000,
        output_nanos_per_mtok=10_000_000_000,
        cache_read_nanos_per_mtok=1_250_000_000,
    )
    gpt = LLMModel.objects.create(name="gpt-4o", provider="openai")
    HostBinding.objects.create(
        model=gpt, host=openai, adapter="openai", upstream_name="gpt-4o-2024-08-06", pricing=price
    )
    claude = LLMModel.objects.create(name="claude-sonnet", provider="anthropic")
    HostBinding.objects.create(model=claude, host=anthropic, adapter="anthropic", upstream_name="claude-sonnet-4")
    resp = LLMModel.objects.create(name="gpt-resp", provider="openai")
    HostBinding.objects.create(model=resp, host=openai, adapter="openai_responses", upstream_name="gpt-4.1")
    keys = []
    for i in range(n_keys):
        k = HostKey(name=f"openai-{i}", host=openai)
        k.set_value(f"upstream-openai-{i}")
        k.save()
        keys.append(k)
    ak = HostKey(name="anthropic-0", host=anthropic)
    ak.set_value("upstream-anthropic-0")
    ak.save()
    keys.append(ak)
    policy = Policy.objects.create(name="pol-a", project=project, grants=list(grants))
    for i, k in enumerate(keys):
        PolicyHostKey.objects.create(policy=policy, host_key=k, position=i)
    sa.policy = policy
    sa.save()
    key_obj, plaintext = create_relay_key(service_account=sa)
    return Catalog(team, project, sa, policy, {"openai": openai, "anthropic": anthropic}, keys, plaintext, key_obj)


def rate_limit(name: str, *rules) -> RateLimit:
    rl = RateLimit.objects.create(name=name)
    for meter, amount, window, strategy in rules:
        RateLimitRule.objects.create(
            rate_limit=rl, meter=meter, amount=amount, window_seconds=window, strategy=strategy
        )
    return rl


def user(username="alice", **kw) -> User:
    return User.objects.create_user(username=username, password="pw-" + username, **kw)
