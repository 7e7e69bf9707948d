"""`relay apply -f FILE.yaml`: upsert the catalog by name, idempotently.

The whole file is validated and applied in one transaction: an invalid file
changes nothing and the error names the bad entry (`bindings[2]: …`).
Applying the same file twice reports every entry as unchanged.
"""

import os
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

import yaml
from django.db import transaction

from core import crypto, hostkinds
from core.models import (
    ACCOUNT_ID_RE,
    Adapter,
    BatchMode,
    Host,
    HostBinding,
    HostKey,
    LLMModel,
    Pricing,
    Project,
    ServiceAccount,
    Team,
    kind_binding_problem,
)
from policies.models import KeySelection, Meter, Policy, PolicyHostKey, RateLimit, RateLimitRule, Strategy
from usage.budgets import parse_usd
from usage.models import SCOPE_KINDS, Budget, Period

TOP_LEVEL = (
    "teams",
    "projects",
    "service_accounts",
    "hosts",
    "models",
    "pricing",
    "bindings",
    "rate_limits",
    "host_keys",
    "policies",
    "budgets",
)
NANOS_PER_USD = Decimal(1_000_000_000)


class ConfigError(Exception):
    pass


@dataclass
class ApplyReport:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    # Applied, but will not work as it is (a host key whose environment variable is unset here).
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return f"{len(self.created)} created, {len(self.updated)} updated, {len(self.unchanged)} unchanged"


def load_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return doc or {}


def apply_config(doc: dict) -> ApplyReport:
    if not isinstance(doc, dict):
        raise ConfigError("the file must be a mapping with keys: " + ", ".join(TOP_LEVEL))
    unknown = sorted(set(doc) - set(TOP_LEVEL))
    if unknown:
        raise ConfigError(f"unknown top-level key(s): {', '.join(unknown)}; allowed: {', '.join(TOP_LEVEL)}")
    report = ApplyReport()
    with transaction.atomic():
        # Order follows references: a policy names host keys, a key names a host…
        for section in TOP_LEVEL:
            entries = doc.get(section) or []
            if not isinstance(entries, list):
                raise ConfigError(f"{section}: must be a list")
            for i, entry in enumerate(entries):
                where = f"{section}[{i}]"
                if not isinstance(entry, dict):
                    raise ConfigError(f"{where}: must be a mapping")
                try:
                    _APPLIERS[section](entry, report, where)
                except ConfigError as exc:
                    raise ConfigError(f"{where}: {exc}") from exc
        # A host's new kind must serve the bindings already on it, the file's and those it does not name.
        _check_host_bindings(doc.get("hosts") or [])
        # Second pass: project default policies point forward to policies.
        for i, entry in enumerate(doc.get("projects") or []):
            if entry.get("default_policy"):
                project = Project.objects.get(name=entry["name"])
                policy = _ref(Policy, entry["default_policy"], "policy", f"projects[{i}]")
                if project.default_policy_id != policy.id:
                    project.default_policy = policy
                    project.save(update_fields=["default_policy"])
        for i, entry in enumerate(doc.get("service_accounts") or []):
            if entry.get("policy"):
                sa = ServiceAccount.objects.get(project__name=entry["project"], name=entry["name"])
                policy = _ref(Policy, entry["policy"], "policy", f"service_accounts[{i}]")
                if sa.policy_id != policy.id:
                    sa.policy = policy
                    sa.save(update_fields=["policy"])
    return report


# --- helpers -----------------------------------------------------------------


def _allowed(entry: dict, *keys: str) -> None:
    extra = sorted(set(entry) - set(keys))
    if extra:
        raise ConfigError(f"unknown field(s): {', '.join(extra)}; allowed: {', '.join(keys)}")


def _required(entry: dict, key: str):
    value = entry.get(key)
    if value in (None, ""):
        raise ConfigError(f"missing required field '{key}'")
    return value


def _text(entry: dict, key: str, max_length: int) -> str:
    value = entry.get(key)
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > max_length or not ACCOUNT_ID_RE.match(value):
        raise ConfigError(f"'{key}' must be an id such as org-… or proj_… (letters, digits, '-', '_', '.')")
    return value


def _ref(model, name, what: str, where: str = ""):
    obj = model.objects.filter(name=name).first()
    if obj is None:
        prefix = f"{where}: " if where else ""
        raise ConfigError(f"{prefix}unknown {what} '{name}'")
    return obj


def _choice(value, choices, what: str):
    allowed = [c.value for c in choices]
    if value not in allowed:
        raise ConfigError(f"{what} '{value}' is not one of {', '.join(allowed)}")
    return value


def _bool(entry: dict, key: str, default: bool) -> bool:
    value = entry.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"'{key}' must be true or false")
    return value


def _upsert(model, lookup: dict, values: dict, report: ApplyReport, label: str):
    """Create or update by natural key; report whether anything changed."""
    obj = model.objects.filter(**lookup).first()
    if obj is None:
        obj = model(**lookup, **values)
        obj.full_clean(validate_unique=False, validate_constraints=False)
        obj.save()
        report.created.append(label)
        return obj, True
    changed = [k for k, v in values.items() if getattr(obj, k) != v]
    if changed:
        for k in changed:
            setattr(obj, k, values[k])
        obj.full_clean(validate_unique=False, validate_constraints=False)
        obj.save()
        report.updated.append(label)
    else:
        report.unchanged.append(label)
    return obj, bool(changed)


def _wrap_validation(fn):
    from django.core.exceptions import ValidationError

    def inner(entry, report, where):
        try:
            return fn(entry, report, where)
        except ValidationError as exc:
            msgs = "; ".join(f"{k}: {', '.join(v)}" for k, v in exc.message_dict.items())
            raise ConfigError(msgs) from exc

    return inner


def _usd_per_mtok_to_nanos(value, what: str) -> int | None:
    if value is None:
        return None
    try:
        amount = Decimal(str(value))
    except InvalidOperation as exc:
        raise ConfigError(f"{what} must be a number of USD per million tokens") from exc
    if amount < 0:
        raise ConfigError(f"{what} must not be negative")
    nanos = amount * NANOS_PER_USD
    if nanos != nanos.to_integral_value():
        raise ConfigError(f"{what} has more precision than 1 nano-USD per million tokens")
    return int(nanos)


# --- one applier per section ---------------------------------------------------


@_wrap_validation
def _team(e, report, where):
    _allowed(e, "name")
    _upsert(Team, {"name": _required(e, "name")}, {}, report, f"team {e['name']}")


@_wrap_validation
def _project(e, report, where):
    _allowed(e, "name", "team", "default_policy")
    team = _ref(Team, _required(e, "team"), "team")
    _upsert(Project, {"name": _required(e, "name")}, {"team": team}, report, f"project {e['name']}")


@_wrap_validation
def _service_account(e, report, where):
    _allowed(e, "name", "project", "policy")
    project = _ref(Project, _required(e, "project"), "project")
    _upsert(
        ServiceAccount,
        {"project": project, "name": _required(e, "name")},
        {},
        report,
        f"service account {project.name}/{e['name']}",
    )


@_wrap_validation
def _host(e, report, where):
    """`{name, kind, base_url, <the kind's settings>}`: without `kind`, each binding's adapter picks OpenAI's or
    Anthropic's wire (core.hostkinds.NATIVE); a kind with a well-known endpoint fills in `base_url`."""
    kind_name = e.get("kind") or ""
    if not isinstance(kind_name, str) or (kind_name and kind_name not in hostkinds.REGISTRY):
        raise ConfigError(f"kind '{kind_name}' is not one of {', '.join(hostkinds.REGISTRY)}")
    kind = hostkinds.get(kind_name) if kind_name else None
    settings = [o.name for o in kind.options] if kind else []
    _allowed(e, "name", "kind", "base_url", *settings)
    base_url = e.get("base_url") or (kind.default_base_url if kind else "")
    if not base_url:
        raise ConfigError("missing required field 'base_url'")
    options = {name: e[name] for name in settings if name in e}
    _upsert(
        Host,
        {"name": _required(e, "name")},
        {"base_url": str(base_url).rstrip("/"), "kind": kind_name, "options": options},
        report,
        f"host {e['name']}",
    )


@_wrap_validation
def _model(e, report, where):
    _allowed(e, "name", "provider")
    _upsert(
        LLMModel,
        {"name": str(_required(e, "name"))},
        {"provider": _required(e, "provider")},
        report,
        f"model {e['name']}",
    )


@_wrap_validation
def _pricing(e, report, where):
    fields = ("input", "output", "cache_read", "cache_write", "batch_input", "batch_output")
    _allowed(e, "name", *fields, "long_context")
    values = {f"{f}_nanos_per_mtok": _usd_per_mtok_to_nanos(e.get(f), f) for f in fields}
    values.update(_long_context(e.get("long_context")))
    _upsert(Pricing, {"name": _required(e, "name")}, values, report, f"pricing {e['name']}")


LONG_RATES = ("input", "output", "cache_read", "cache_write")


def _long_context(tier) -> dict:
    """`long_context: {above_input_tokens: 200000, input: 6, output: 22.5, cache_read: 0.6, cache_write: 7.5}`:
    the rates of every token of a request whose input side is above the threshold (usage.pricing)."""
    values = {"long_context_threshold_tokens": None, **{f"long_{f}_nanos_per_mtok": None for f in LONG_RATES}}
    if tier is None:
        return values
    if not isinstance(tier, dict):
        raise ConfigError("'long_context' must be a mapping: {above_input_tokens: N, input: USD, output: USD, …}")
    try:
        _allowed(tier, "above_input_tokens", *LONG_RATES)
        threshold = tier.get("above_input_tokens")
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold <= 0:
            raise ConfigError("'above_input_tokens' must be a positive integer (Anthropic's 1M-context tier: 200000)")
        if tier.get("input") is None or tier.get("output") is None:
            raise ConfigError("give at least the 'input' and 'output' rates above the threshold")
    except ConfigError as exc:
        raise ConfigError(f"long_context: {exc}") from exc
    values["long_context_threshold_tokens"] = threshold
    for f in LONG_RATES:
        values[f"long_{f}_nanos_per_mtok"] = _usd_per_mtok_to_nanos(tier.get(f), f"long_context.{f}")
    return values


@_wrap_validation
def _binding(e, report, where):
    _allowed(e, "model", "host", "adapter", "upstream_name", "pricing", "enabled", "batch_mode", "allowed_betas")
    model = _ref(LLMModel, str(_required(e, "model")), "model")
    host = _ref(Host, _required(e, "host"), "host")
    pricing = _ref(Pricing, e["pricing"], "pricing") if e.get("pricing") else None
    values = {
        "adapter": _choice(e.get("adapter", "openai"), Adapter, "adapter"),
        "upstream_name": str(e.get("upstream_name") or model.name),
        "pricing": pricing,
        "enabled": _bool(e, "enabled", True),
        "batch_mode": _choice(e.get("batch_mode", BatchMode.RELAY), BatchMode, "batch_mode"),
        # Checked with the binding's adapter and pricing by HostBinding.clean (core.models.betas_problem).
        "allowed_betas": e.get("allowed_betas") or [],
    }
    _upsert(HostBinding, {"model": model, "host": host}, values, report, f"binding {model.name}@{host.name}")


@_wrap_validation
def _rate_limit(e, report, where):
    _allowed(e, "name", "rules", "enabled")
    rules = e.get("rules") or []
    if not isinstance(rules, list) or not rules:
        raise ConfigError("'rules' must be a non-empty list")
    wanted = []
    for j, r in enumerate(rules):
        if not isinstance(r, dict):
            raise ConfigError(f"rules[{j}]: must be a mapping")
        try:
            _allowed(r, "meter", "amount", "window", "strategy")
            amount, window = r.get("amount"), r.get("window")
            if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
                raise ConfigError("'amount' must be a positive integer")
            if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
                raise ConfigError("window must be an integer number of seconds")
            wanted.append(
                (
                    _choice(_required(r, "meter"), Meter, "meter"),
                    amount,
                    window,
                    _choice(r.get("strategy", "sliding-window"), Strategy, "strategy"),
                )
            )
        except ConfigError as exc:
            raise ConfigError(f"rules[{j}]: {exc}") from exc
    rl, changed = _upsert(
        RateLimit,
        {"name": _required(e, "name")},
        {"enabled": _bool(e, "enabled", True)},
        report,
        f"rate limit {e['name']}",
    )
    current = [(r.meter, r.amount, r.window_seconds, r.strategy) for r in rl.rules.order_by("id")]
    if current != wanted:
        rl.rules.all().delete()
        RateLimitRule.objects.bulk_create(
            RateLimitRule(rate_limit=rl, meter=m, amount=a, window_seconds=w, strategy=s) for m, a, w, s in wanted
        )
        _mark_updated(report, f"rate limit {rl.name}")


@_wrap_validation
def _host_key(e, report, where):
    _allowed(e, "name", "host", "value", "value_from", "rate_limit", "enabled", "openai_organization", "openai_project")
    host = _ref(Host, _required(e, "host"), "host")
    has_value, has_from = "value" in e, "value_from" in e
    if has_value == has_from:
        raise ConfigError("give exactly one of 'value' or 'value_from: {env: NAME}'")
    env_name = ""
    if has_from:
        vf = e["value_from"]
        if not isinstance(vf, dict) or set(vf) != {"env"} or not vf["env"]:
            raise ConfigError("'value_from' must be {env: NAME}")
        env_name = str(vf["env"])
        problem = HostKey.env_problem(env_name)
        if problem:
            raise ConfigError(f"value_from: {problem}")
    elif not e["value"]:
        raise ConfigError("'value' must not be empty")
    rate_limit = _ref(RateLimit, e["rate_limit"], "rate limit") if e.get("rate_limit") else None
    account = {f: _text(e, f, 200) for f in ("openai_organization", "openai_project")}
    label = f"host key {e['name']}"
    if env_name and not os.environ.get(env_name):
        report.warnings.append(
            f"{label}: environment variable {env_name} is not set in this process; requests routed to this key "
            "fail with no_keys until the relay runs with it set"
        )
    key = HostKey.objects.filter(name=_required(e, "name")).first()
    if key is None:
        key = HostKey(
            name=e["name"],
            host=host,
            value_env=env_name,
            rate_limit=rate_limit,
            enabled=_bool(e, "enabled", True),
            **account,
        )
        if has_value:
            key.set_value(str(e["value"]))
        key.save()
        report.created.append(label)
        return
    changed = False
    wanted = {"host": host, "rate_limit": rate_limit, "enabled": _bool(e, "enabled", True), **account}
    for attr, value in wanted.items():
        if getattr(key, attr) != value:
            setattr(key, attr, value)
            changed = True
    if has_from and key.value_env != env_name:
        key.value_env, key.value_encrypted, changed = env_name, "", True
    if has_value:
        # The ciphertext differs every time (random nonce): compare plaintexts.
        try:
            same = not key.value_env and key.get_value() == str(e["value"])
        except crypto.SecretUnavailable:
            same = False
        if not same:
            key.set_value(str(e["value"]))
            changed = True
    if changed:
        key.save()
        report.updated.append(label)
    else:
        report.unchanged.append(label)


@_wrap_validation
def _policy(e, report, where):
    _allowed(
        e,
        "name",
        "project",
        "models",
        "host_keys",
        "key_selection",
        "rate_limit",
        "enabled",
        "batch_enabled",
        "batch_share",
    )
    grants = e.get("models") or []
    if not isinstance(grants, list) or not all(isinstance(g, str) and g for g in grants):
        raise ConfigError("'models' must be a list of grants such as openai/gpt-4o@openai, openai/*, *")
    for g in grants:
        validate_grant(g)
    keys = e.get("host_keys") or []
    if not isinstance(keys, list):
        raise ConfigError("'host_keys' must be a list of host key names")
    key_objs = [_ref(HostKey, k, "host key") for k in keys]
    values = {
        "project": _ref(Project, e["project"], "project") if e.get("project") else None,
        "grants": grants,
        "key_selection": _choice(e.get("key_selection", "prioritized"), KeySelection, "key_selection"),
        "rate_limit": _ref(RateLimit, e["rate_limit"], "rate limit") if e.get("rate_limit") else None,
        "enabled": _bool(e, "enabled", True),
        "batch_enabled": _bool(e, "batch_enabled", True),
        "batch_share": _share(e.get("batch_share", "0.8")),
    }
    policy, _ = _upsert(Policy, {"name": _required(e, "name")}, values, report, f"policy {e['name']}")
    current = list(policy.pool_links.order_by("position").values_list("host_key_id", flat=True))
    if current != [k.id for k in key_objs]:
        policy.pool_links.all().delete()
        PolicyHostKey.objects.bulk_create(
            PolicyHostKey(policy=policy, host_key=k, position=i) for i, k in enumerate(key_objs)
        )
        _mark_updated(report, f"policy {policy.name}")


@_wrap_validation
def _budget(e, report, where):
    """A spend budget: exactly one of project / team / service_account / policy, `usd` per `period`."""
    _allowed(e, "name", *SCOPE_KINDS, "usd", "period", "enabled")
    name = _required(e, "name")
    given = [kind for kind in SCOPE_KINDS if e.get(kind) not in (None, "")]
    if len(given) != 1:
        named = f" (got {', '.join(given)})" if given else ""
        raise ConfigError(f"give exactly one of {', '.join(SCOPE_KINDS)}{named}")
    kind = given[0]
    if kind == "service_account":
        target = _service_account_ref(str(e[kind]))
    else:
        model = {"project": Project, "team": Team, "policy": Policy}[kind]
        target = _ref(model, e[kind], kind.replace("_", " "))
    if "usd" not in e:
        raise ConfigError("missing required field 'usd'")
    try:
        usd_nanos = parse_usd(e["usd"])
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    values = {scope: None for scope in SCOPE_KINDS}
    values.update(
        {
            kind: target,
            "usd_nanos": usd_nanos,
            "period": _choice(e.get("period", Period.MONTH), Period, "period"),
            "enabled": _bool(e, "enabled", True),
        }
    )
    _upsert(Budget, {"name": name}, values, report, f"budget {name}")


def _service_account_ref(value: str) -> ServiceAccount:
    """`project/name`, or a name only one project has."""
    project, _, name = value.rpartition("/")
    matches = ServiceAccount.objects.filter(name=name)
    if project:
        matches = matches.filter(project__name=project)
    found = list(matches.select_related("project")[:2])
    if not found:
        raise ConfigError(f"unknown service account '{value}'")
    if len(found) > 1:
        raise ConfigError(f"service account '{value}' is in several projects: write it as project/name")
    return found[0]


def _share(value) -> Decimal:
    """A policy's batch_share: a number from 0 to 1 with at most two decimals."""
    if isinstance(value, bool):
        raise ConfigError("'batch_share' must be a number from 0 to 1, such as 0.8")
    try:
        share = Decimal(str(value))
    except (ArithmeticError, ValueError, InvalidOperation):
        raise ConfigError("'batch_share' must be a number from 0 to 1, such as 0.8") from None
    if not share.is_finite() or not 0 <= share <= 1 or share != share.quantize(Decimal("0.01")):
        raise ConfigError("'batch_share' must be a number from 0 to 1 with at most two decimals, such as 0.8")
    return share.quantize(Decimal("0.01"))


def validate_grant(grant: str) -> None:
    """`*`, `provider`, `provider/*`, `provider/model`, `provider/model@host` (host may be `*`)."""
    if grant == "*":
        return
    provider, _, rest = grant.partition("/")
    model, _, host = rest.partition("@")
    if not provider or (rest and not model) or ("@" in rest and not host) or "@" in provider:
        raise ConfigError(f"grant '{grant}' is not of the form provider[/model[@host]] or *")


def _check_host_bindings(hosts: list) -> None:
    for i, entry in enumerate(hosts):
        host = Host.objects.filter(name=entry.get("name")).first()
        if host is None or not host.kind:
            continue
        for binding in host.bindings.select_related("model").order_by("id"):
            problem = kind_binding_problem(host, binding.adapter, binding.batch_mode)
            if problem:
                raise ConfigError(f"hosts[{i}]: binding {binding.model.name}@{host.name}: {problem}")


def _mark_updated(report: ApplyReport, label: str) -> None:
    if label in report.unchanged:
        report.unchanged.remove(label)
    if label not in report.updated and label not in report.created:
        report.updated.append(label)


_APPLIERS = {
    "teams": _team,
    "projects": _project,
    "service_accounts": _service_account,
    "hosts": _host,
    "models": _model,
    "pricing": _pricing,
    "bindings": _binding,
    "rate_limits": _rate_limit,
    "host_keys": _host_key,
    "policies": _policy,
    "budgets": _budget,
}
