"""Model grants: `*`, `provider`, `provider/*`, `provider/model`, `provider/model@host`."""


def grant_matches(grant: str, provider: str, model: str, host: str) -> bool:
    if grant == "*":
        return True
    g_provider, _, rest = grant.partition("/")
    if g_provider != provider:
        return False
    if not rest or rest == "*":
        return True
    g_model, _, g_host = rest.partition("@")
    if g_model != model:
        return False
    return not g_host or g_host == "*" or g_host == host


def granted(grants: list[str], provider: str, model: str, host: str) -> bool:
    return any(grant_matches(g, provider, model, host) for g in grants)
