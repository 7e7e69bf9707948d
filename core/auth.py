"""Authentication of inference callers: relay keys and inference tokens.

`authenticate(request)` turns the request's credential into a Principal or
raises AuthError with one of the product's messages. `recheck(principal)`
re-validates a stored principal when a batch item runs: the credential may
have been disabled, revoked, expired or rotated out since submit.
"""

from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import jwt
from django.db import connection
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from core import catalog, crypto
from core.errors import AuthError, RelayError
from core.models import Project, RelayKey, RevokedToken, User

TOKEN_ISSUER = "relay"


@dataclass(frozen=True)
class Principal:
    principal_kind: str  # "serviceaccount" | "user"
    principal_id: int
    credential_kind: str  # "key" | "token"
    credential_id: str  # relay key id, or the token's jti
    owner_hash: str  # what batch ownership is matched on (see owner_hash())
    project_id: int | None
    team_id: int | None
    policy_id: int | None
    token_exp: int | None = None
    token_ver: int | None = None
    key_hash: str = ""  # sha256 of the relay key value that authenticated; "" for tokens
    # Names as of authentication, for usage events (no lookups per request).
    project_name: str = ""
    team_name: str = ""

    def as_dict(self) -> dict:
        return asdict(self)

    def attribution(self) -> dict:
        """Who a row belongs to and is billed to: the owner and attribution columns that
        batches, files (their subset), result files and usage events all take from here."""
        return {
            "owner_hash": self.owner_hash,
            "credential_kind": self.credential_kind,
            "credential_id": self.credential_id,
            "principal_kind": self.principal_kind,
            "principal_id": self.principal_id,
            "project_id": self.project_id,
            "team_id": self.team_id,
            "policy_id": self.policy_id,
        }

    def usage_attribution(self) -> dict:
        """The attribution fields of a usage event: the same mapping, with the names as of authentication."""
        fields = self.attribution()
        del fields["owner_hash"]
        return {**fields, "project": self.project_name, "team": self.team_name}

    @classmethod
    def from_dict(cls, data: dict) -> "Principal":
        return cls(**data)


def authorization_bearer(headers) -> str:
    """The token of an `Authorization: Bearer …` header ("" when there is none): the one bearer parser."""
    value = headers.get("Authorization", "").strip()
    return value[7:].strip() if value[:7].lower() == "bearer " else ""


def bearer_from_headers(headers) -> str:
    """X-WR-API-Key, then Authorization: Bearer, then x-api-key (product order)."""
    value = headers.get("X-WR-API-Key", "").strip()
    if value:
        return value
    return authorization_bearer(headers) or headers.get("x-api-key", "").strip()


def is_token(bearer: str) -> bool:
    return bearer.startswith("ey") and bearer.count(".") == 2


_CURRENT = object()


def authenticate(request, snapshot=_CURRENT) -> Principal:
    """`snapshot`: the catalog snapshot a relay key's row is cached in (core.catalog); by
    default the one current in Redis. The live view passes the snapshot it holds and
    has the key pick confirm it (gateway.pipeline)."""
    bearer = bearer_from_headers(request.headers)
    if not bearer:
        raise AuthError("missing relay key")
    if is_token(bearer):
        return _principal_from_token(bearer)
    return _principal_from_key(bearer, catalog.current() if snapshot is _CURRENT else snapshot)


# --- relay keys -------------------------------------------------------------


# The lookup of every request, written once as SQL: through the ORM, compiling
# this five-table join cost several times its execution (benchmark: ~9 ms of
# CPU per request on a 2-core machine). Plain SQL that SQLite and PostgreSQL
# both run; the columns are named like the ORM lookups they replace.
_KEY_FIELDS = (
    "id",
    "key_hash",
    "grace_until",
    "enabled",
    "revoked_at",
    "expires_at",
    "policy_id",
    "user_id",
    "user__is_active",
    "service_account_id",
    "service_account__policy_id",
    "service_account__project_id",
    "service_account__project__name",
    "service_account__project__team_id",
    "service_account__project__team__name",
    "service_account__project__default_policy_id",
    "project_id",
    "project__name",
    "project__team_id",
    "project__team__name",
    "project__default_policy_id",
)
_KEY_SQL = """
SELECT k.id, k.key_hash, k.grace_until, k.enabled, k.revoked_at, k.expires_at, k.policy_id,
       k.user_id, u.is_active,
       k.service_account_id, sa.policy_id, sa.project_id, sp.name, sp.team_id, st.name, sp.default_policy_id,
       k.project_id, p.name, p.team_id, pt.name, p.default_policy_id
FROM relay_relaykey k
LEFT JOIN relay_user u ON u.id = k.user_id
LEFT JOIN relay_serviceaccount sa ON sa.id = k.service_account_id
LEFT JOIN relay_project sp ON sp.id = sa.project_id
LEFT JOIN relay_team st ON st.id = sp.team_id
LEFT JOIN relay_project p ON p.id = k.project_id
LEFT JOIN relay_team pt ON pt.id = p.team_id
WHERE k.key_hash = %s OR k.previous_key_hash = %s
"""


def _key_row(key_hash: str, snapshot) -> dict | None:
    """The key's row from the catalog snapshot, or one query (a key not found is never cached)."""
    if snapshot is None:
        return _find_key(key_hash)
    row = snapshot.relay_keys.get(key_hash)
    if row is None:
        row = _find_key(key_hash)
        if row is not None:
            snapshot.relay_keys[key_hash] = row
    return row


def _find_key(key_hash: str) -> dict | None:
    with connection.cursor() as cursor:
        cursor.execute(_KEY_SQL, [key_hash, key_hash])
        row = cursor.fetchone()
    if row is None:
        return None
    key = dict(zip(_KEY_FIELDS, row, strict=True))
    # SQLite hands back booleans as integers and datetimes naive (stored as UTC).
    for name in ("enabled", "user__is_active"):
        if key[name] is not None:
            key[name] = bool(key[name])
    for name in ("grace_until", "revoked_at", "expires_at"):
        value = key[name]
        if isinstance(value, str):
            value = parse_datetime(value)
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        key[name] = value
    return key


def principal_for_key(bearer: str) -> Principal:
    """The principal a relay key value authenticates as (AuthError if it does not): what a request
    presenting it would be. Public for the CLI and the tests."""
    return _principal_from_key(bearer, catalog.current())


def _principal_from_key(bearer: str, snapshot=None) -> Principal:
    key_hash = crypto.sha256_hex(bearer)
    key = _key_row(key_hash, snapshot)
    if key is None:
        raise AuthError("invalid api key")
    if key["key_hash"] != key_hash:  # the previous value of a rotated key
        if not key["grace_until"] or key["grace_until"] <= timezone.now():
            raise AuthError("api key rotated")
    _check_key_fields(
        key["enabled"], key["revoked_at"], key["expires_at"], key["user__is_active"] if key["user_id"] else True
    )
    return _key_principal(key, key_hash)


def _check_key_fields(enabled, revoked_at, expires_at, user_active) -> None:
    if not enabled:
        raise AuthError("api key disabled")
    if revoked_at is not None:
        raise AuthError("api key revoked")
    if expires_at is not None and expires_at <= timezone.now():
        raise AuthError("api key expired")
    if not user_active:
        raise AuthError("api key disabled")


def _key_principal(key: dict, key_hash: str) -> Principal:
    if key["service_account_id"]:
        prefix, kind, pid = "service_account__project", "serviceaccount", key["service_account_id"]
        policy_id = key["policy_id"] or key["service_account__policy_id"] or key[f"{prefix}__default_policy_id"]
    else:
        # A personal key takes its tenancy from the project it was made for, if any.
        prefix, kind, pid = "project", "user", key["user_id"]
        policy_id = key["policy_id"] or key[f"{prefix}__default_policy_id"]
    project_id = key["service_account__project_id"] if key["service_account_id"] else key["project_id"]
    return Principal(
        principal_kind=kind,
        principal_id=pid,
        credential_kind="key",
        credential_id=str(key["id"]),
        # Ownership follows the key's *current* value: after a rotation the new
        # value does not see what the old one submitted (product behaviour).
        owner_hash=key_hash,
        project_id=project_id,
        team_id=key[f"{prefix}__team_id"],
        policy_id=policy_id,
        key_hash=key_hash,
        project_name=key[f"{prefix}__name"] or "",
        team_name=key[f"{prefix}__team__name"] or "",
    )


# --- inference tokens -------------------------------------------------------


def mint_token(user: User, project: Project, ttl_seconds: int) -> dict:
    import uuid

    now = int(datetime.now(UTC).timestamp())
    claims = {
        "iss": TOKEN_ISSUER,
        "sub": f"user:{user.id}",
        "prj": project.id,
        "ver": user.token_version,
        "jti": uuid.uuid4().hex,
        "iat": now,
        "exp": now + ttl_seconds,
    }
    token = jwt.encode(claims, crypto.token_signing_key(), algorithm="EdDSA")
    return {"token": token, "jti": claims["jti"], "expires_at": claims["exp"], "project": project.name}


def _decode(bearer: str, verify_exp: bool = True) -> dict:
    public = crypto.token_signing_key().public_key()
    try:
        return jwt.decode(
            bearer,
            public,
            algorithms=["EdDSA"],
            issuer=TOKEN_ISSUER,
            options={"require": ["exp", "sub", "jti", "ver", "prj"], "verify_exp": verify_exp},
        )
    except jwt.ExpiredSignatureError as exc:
        raise AuthError("token expired") from exc
    except jwt.PyJWTError as exc:
        raise AuthError("invalid token") from exc


def _principal_from_token(bearer: str) -> Principal:
    claims = _decode(bearer)
    sub = str(claims["sub"])
    if not sub.startswith("user:") or not sub[5:].isdigit():
        raise AuthError("invalid token")
    user = User.objects.filter(pk=int(sub[5:])).first()
    if user is None:
        raise AuthError("invalid token")
    _check_token_state(user, claims["ver"], claims["jti"])
    project = Project.objects.select_related("team").filter(pk=claims["prj"]).first()
    if project is None:
        raise RelayError(403, "project_unavailable", "the token's project no longer exists")
    return Principal(
        principal_kind="user",
        principal_id=user.id,
        credential_kind="token",
        credential_id=claims["jti"],
        # Any token of the same user sees the user's batches.
        owner_hash=f"user:{user.id}",
        project_id=project.id,
        team_id=project.team_id,
        policy_id=project.default_policy_id,
        token_exp=claims["exp"],
        token_ver=claims["ver"],
        project_name=project.name,
        team_name=project.team.name,
    )


def _check_token_state(user: User, ver: int, jti: str) -> None:
    if not user.is_active or user.token_version != ver:
        raise AuthError("token revoked", code="token_revoked")
    if RevokedToken.objects.filter(jti=jti).exists():
        raise AuthError("token revoked", code="token_revoked")


def revoke_token_jti(jti: str, expires_at: datetime) -> None:
    RevokedToken.objects.update_or_create(jti=jti, defaults={"expires_at": expires_at})


def revoke_token(bearer: str) -> str:
    """Revoke a presented token (it need not be valid any more, only genuine)."""
    claims = _decode(bearer, verify_exp=False)
    revoke_token_jti(claims["jti"], datetime.fromtimestamp(claims["exp"], UTC))
    return claims["jti"]


# --- re-check at item run time ----------------------------------------------


_KEY_STATE_FIELDS = ("key_hash", "previous_key_hash", "grace_until", "enabled", "revoked_at", "expires_at", "user_id")
_KEY_STATE_SQL: list[str] = []


def _key_state(key_id: int) -> dict | None:
    """The fields `recheck` needs of one relay key (and its user's is_active), by primary key.

    Runs once per batch item, so the SQL is written once, not compiled by the ORM each time (that
    compilation was ~15% of a batch worker's CPU per item)."""
    if not _KEY_STATE_SQL:
        qn = connection.ops.quote_name
        key_t, user_t = RelayKey._meta.db_table, User._meta.db_table
        cols = ", ".join(f"k.{qn(RelayKey._meta.get_field(f).column)}" for f in _KEY_STATE_FIELDS)
        _KEY_STATE_SQL.append(
            f"SELECT {cols}, u.{qn('is_active')} FROM {qn(key_t)} k "
            f"LEFT JOIN {qn(user_t)} u ON u.{qn('id')} = k.{qn(RelayKey._meta.get_field('user').column)} "
            f"WHERE k.{qn('id')} = %s"
        )
    with connection.cursor() as cursor:
        cursor.execute(_KEY_STATE_SQL[0], [key_id])
        row = cursor.fetchone()
    if row is None:
        return None
    key = dict(zip(_KEY_STATE_FIELDS, row[:-1], strict=True))
    key["user_active"] = row[-1]
    if connection.vendor != "postgresql":  # SQLite: booleans and datetimes come back as stored
        for name in ("grace_until", "revoked_at", "expires_at"):
            key[name] = RelayKey._meta.get_field(name).to_python(key[name]) if key[name] is not None else None
            if key[name] is not None and timezone.is_naive(key[name]):
                key[name] = timezone.make_aware(key[name], UTC)
        key["enabled"], key["user_active"] = bool(key["enabled"]), bool(key["user_active"])
    return key


_GONE = object()


def _cached_key_state(key_id: int, snapshot) -> dict | None:
    """`_key_state` kept in the catalog snapshot (core.catalog): relay keys' writes bump it. A key
    that is gone stays gone (ids are never reused), so that answer is kept too."""
    if snapshot is None:
        return _key_state(key_id)
    state = snapshot.relay_keys.get(("state", key_id))
    if state is None:
        state = _key_state(key_id)
        snapshot.relay_keys[("state", key_id)] = _GONE if state is None else state
    return None if state is _GONE else state


def recheck(principal: Principal, snapshot=_CURRENT) -> None:
    """Raise AuthError if the credential stopped working since the principal was made. A relay key's
    state comes from `snapshot` (by default the catalog snapshot current in Redis), so a batch item
    re-checks its credential without a query while nothing was written."""
    if principal.credential_kind == "key":
        snap = catalog.current() if snapshot is _CURRENT else snapshot
        key = _cached_key_state(int(principal.credential_id), snap)
        if key is None:
            raise AuthError("api key revoked")
        if key["key_hash"] != principal.key_hash:
            # Submitted with a value that has since been rotated.
            grace = key["grace_until"]
            if key["previous_key_hash"] != principal.key_hash or not grace or grace <= timezone.now():
                raise AuthError("api key rotated")
        _check_key_fields(
            key["enabled"], key["revoked_at"], key["expires_at"], key["user_active"] if key["user_id"] else True
        )
        return
    if principal.token_exp is not None and principal.token_exp <= timezone.now().timestamp():
        raise AuthError("token expired")
    user = User.objects.filter(pk=principal.principal_id).first()
    if user is None:
        raise AuthError("invalid token")
    _check_token_state(user, principal.token_ver, principal.credential_id)
