"""`python manage.py relay …` — the operator CLI.

relay apply -f FILE.yaml
relay key create --service-account PROJECT/SA | --user U --project P  [--policy P] [--expires 30d|RFC3339] [--name N]
relay key rotate|revoke|disable|enable --id ID | --prefix sk-wr-XXXXXXXX  [--grace 3600]
relay token mint --user U --project P [--ttl 1h]
relay token revoke --jti JTI | --token TOKEN | --user U --all
"""

from datetime import UTC, datetime, timedelta

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from core import auth, services
from core.durations import parse_duration
from core.errors import RelayError
from core.models import Project, RelayKey, ServiceAccount, User
from policies.models import Policy
from relay.config_apply import ConfigError, apply_config, load_file


def duration_seconds(text: str) -> int:
    try:
        duration = parse_duration(text)
    except OverflowError:
        duration = None
    if duration is None:
        raise CommandError(f"'{text}' is not a duration like 90s, 15m, 1h or 30d")
    return int(duration.total_seconds())


def parse_expiry(text: str) -> datetime:
    duration = parse_duration(text)
    if duration is not None:
        return timezone.now() + duration
    when = parse_datetime(text)
    if when is None:
        raise CommandError(f"--expires '{text}' is neither a duration (30d) nor an RFC 3339 time")
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when


class Command(BaseCommand):
    help = "Relay operator commands: apply a catalog file, manage relay keys and inference tokens."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="cmd", required=True)
        ap = sub.add_parser("apply", help="upsert the catalog from a YAML file")
        ap.add_argument("-f", "--file", required=True)

        key = sub.add_parser("key", help="relay keys").add_subparsers(dest="action", required=True)
        create = key.add_parser("create")
        create.add_argument("--service-account", help="PROJECT/NAME")
        create.add_argument("--user")
        create.add_argument("--project", help="for a personal (user) key")
        create.add_argument("--policy")
        create.add_argument("--expires")
        create.add_argument("--name", default="")
        for action in ("rotate", "revoke", "disable", "enable"):
            p = key.add_parser(action)
            p.add_argument("--id", type=int)
            p.add_argument("--prefix")
            if action == "rotate":
                p.add_argument("--grace", default="0", help="seconds, or 15m / 1h; at most 24h")

        token = sub.add_parser("token", help="inference tokens").add_subparsers(dest="action", required=True)
        mint = token.add_parser("mint")
        mint.add_argument("--user", required=True)
        mint.add_argument("--project", required=True)
        mint.add_argument("--ttl", default="1h")
        revoke = token.add_parser("revoke")
        revoke.add_argument("--jti")
        revoke.add_argument("--token")
        revoke.add_argument("--user")
        revoke.add_argument("--all", action="store_true", help="with --user: revoke every token of the user")

    def handle(self, *args, **opts):
        try:
            getattr(self, f"_{opts['cmd']}")(opts)
        except (ConfigError, RelayError) as exc:
            raise CommandError(str(exc)) from exc

    # --- apply ---
    def _apply(self, opts):
        report = apply_config(load_file(opts["file"]))
        for label in report.created:
            self.stdout.write(f"created   {label}")
        for label in report.updated:
            self.stdout.write(f"updated   {label}")
        for warning in report.warnings:
            self.stdout.write(self.style.WARNING(f"warning   {warning}"))
        self.stdout.write(self.style.SUCCESS(f"applied {opts['file']}: {report.summary()}"))

    # --- keys ---
    def _key(self, opts):
        if opts["action"] == "create":
            return self._key_create(opts)
        key = self._find_key(opts)
        if opts["action"] == "rotate":
            grace = opts["grace"]
            seconds = int(grace) if grace.isdigit() else duration_seconds(grace)
            plaintext = services.rotate_relay_key(key, seconds)
            self.stdout.write(plaintext)
            self.stderr.write(f"key {key.id} rotated; the old value works for {seconds}s. Shown once: store it now.")
        elif opts["action"] == "revoke":
            services.revoke_relay_key(key)
            self.stdout.write(f"key {key.id} ({key.prefix}…) revoked")
        else:
            services.set_relay_key_enabled(key, opts["action"] == "enable")
            self.stdout.write(f"key {key.id} ({key.prefix}…) {opts['action']}d")

    def _key_create(self, opts):
        sa = user = project = None
        if bool(opts["service_account"]) == bool(opts["user"]):
            raise CommandError("give exactly one of --service-account PROJECT/NAME or --user USERNAME")
        if opts["service_account"]:
            proj_name, _, sa_name = opts["service_account"].partition("/")
            sa = ServiceAccount.objects.filter(project__name=proj_name, name=sa_name).first()
            if sa is None:
                raise CommandError(f"unknown service account '{opts['service_account']}' (use PROJECT/NAME)")
        else:
            user = self._user(opts["user"])
            if opts["project"]:
                project = self._project(opts["project"])
        policy = None
        if opts["policy"]:
            policy = Policy.objects.filter(name=opts["policy"]).first()
            if policy is None:
                raise CommandError(f"unknown policy '{opts['policy']}'")
        expires = parse_expiry(opts["expires"]) if opts["expires"] else None
        key, plaintext = services.create_relay_key(
            service_account=sa, user=user, project=project, policy=policy, name=opts["name"], expires_at=expires
        )
        self.stdout.write(plaintext)
        self.stderr.write(f"key {key.id} created ({key.prefix}…). The value is shown once and not stored.")

    def _find_key(self, opts) -> RelayKey:
        if opts.get("id"):
            key = RelayKey.objects.filter(pk=opts["id"]).first()
        elif opts.get("prefix"):
            matches = list(RelayKey.objects.filter(prefix=opts["prefix"][:14]))
            if len(matches) > 1:
                raise CommandError(f"prefix '{opts['prefix']}' matches {len(matches)} keys; use --id")
            key = matches[0] if matches else None
        else:
            raise CommandError("give --id or --prefix")
        if key is None:
            raise CommandError("no such relay key")
        return key

    # --- tokens ---
    def _token(self, opts):
        if opts["action"] == "mint":
            user, project = self._user(opts["user"]), self._project(opts["project"])
            minted = auth.mint_token(user, project, duration_seconds(opts["ttl"]))
            self.stdout.write(minted["token"])
            self.stderr.write(f"jti {minted['jti']}, expires {datetime.fromtimestamp(minted['expires_at'], UTC)}")
            return
        if opts["all"]:
            if not opts["user"]:
                raise CommandError("--all needs --user")
            user = self._user(opts["user"])
            user.bump_token_version()
            self.stdout.write(f"every token of {user.username} revoked")
        elif opts["jti"]:
            # Without the token we do not know its expiry: keep the entry for the
            # longest lifetime a token can have.
            auth.revoke_token_jti(opts["jti"], timezone.now() + timedelta(days=366))
            self.stdout.write(f"token {opts['jti']} revoked")
        elif opts["token"]:
            self.stdout.write(f"token {auth.revoke_token(opts['token'])} revoked")
        else:
            raise CommandError("give --jti, --token, or --user U --all")

    @staticmethod
    def _user(name) -> User:
        user = User.objects.filter(username=name).first()
        if user is None:
            raise CommandError(f"unknown user '{name}'")
        return user

    @staticmethod
    def _project(name) -> Project:
        project = Project.objects.filter(name=name).first()
        if project is None:
            raise CommandError(f"unknown project '{name}'")
        return project
