"""The embedded mode's demo catalog, pointed at the demo upstream: `python -m devkit.demo` (what `make run` runs)
applies it and prints the demo relay key. Embedded mode also has it migrate the database first and make the
`admin` user (`--migrate`, `--admin-password-file`): one Python process for its three set-up steps, not three.

Everything here is labelled `demo`; it exists so the README's curl examples
work offline. A real deployment applies its own catalog with `relay apply`.
"""

import argparse
import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit

if __name__ == "__main__":  # run as a script: load Django first, as manage.py does
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "relay.settings")
    django.setup()

from django.conf import settings  # noqa: E402

from core.models import RelayKey, ServiceAccount
from core.services import create_relay_key
from relay.config_apply import apply_config, load_file

DEMO_FILE = Path(settings.BASE_DIR) / "deploy" / "demo-catalog.yaml"
DEMO_KEY_FILE = "demo-relay-key.txt"


def on_upstream(doc: dict, upstream: str) -> dict:
    """The demo catalog with every host on the demo upstream's origin, keeping the path a kind's endpoint has
    (Gemini's /v1beta/openai): the fakes answer each kind under its provider's own paths. A kind's other URL
    settings (`*_url`: Vertex's token endpoint and Cloud Storage) move with it."""
    for host in doc.get("hosts", []):
        for field in ["base_url", *(name for name in host if name.endswith("_url") and name != "base_url")]:
            path = urlsplit(host.get(field) or "").path.rstrip("/")
            host[field] = upstream.rstrip("/") + path
    return doc


def seed_demo() -> str:
    """Apply the demo catalog; create the demo relay key once. Returns its plaintext."""
    os.environ.setdefault("RELAY_HOSTKEY_DEMO", "demo-upstream-key")
    doc = load_file(str(DEMO_FILE))
    apply_config(on_upstream(doc, os.environ.get("RELAY_DEMO_UPSTREAM_URL", "http://127.0.0.1:8090")))
    key_path = Path(settings.BASE_DIR) / ".relay-embedded" / DEMO_KEY_FILE
    sa = ServiceAccount.objects.get(project__name="demo", name="demo-client")
    if key_path.exists():
        plaintext = key_path.read_text().strip()
        from core.crypto import sha256_hex

        if RelayKey.objects.filter(key_hash=sha256_hex(plaintext)).exists():
            return plaintext
    _, plaintext = create_relay_key(service_account=sa, name="demo key")
    key_path.parent.mkdir(parents=True, exist_ok=True)
    key_path.write_text(plaintext + "\n")
    key_path.chmod(0o600)
    return plaintext


def ensure_admin(path: Path) -> str:
    """The `admin` superuser, its password kept in `path` (made once, readable by the owner only). Returns
    the password. With the file already there, nothing is written."""
    if path.exists():
        return path.read_text().strip()
    from core.models import User

    password = secrets.token_urlsafe(12)
    user = User.objects.filter(username="admin").first() or User(username="admin")
    user.is_staff = user.is_superuser = True
    user.set_password(password)
    user.save()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(password + "\n")
    path.chmod(0o600)
    return password


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m devkit.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--migrate", action="store_true", help="apply the migrations first (and the system checks)")
    parser.add_argument("--admin-password-file", type=Path, help="make the admin user; its password in this file")
    args = parser.parse_args(argv)
    if args.migrate:
        from django.core.management import call_command

        # skip_checks=False: `manage.py migrate` runs the system checks; call_command would skip them.
        call_command("migrate", interactive=False, verbosity=0, skip_checks=False)
    key = seed_demo()
    if args.admin_password_file:
        ensure_admin(args.admin_password_file)
    if key:
        print(key)


if __name__ == "__main__":
    main()
