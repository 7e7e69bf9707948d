"""The operator's first day: its papercuts, each checked.

.env.example parses, the launcher stops its whole process tree (also after a failed start),
manage commands see the embedded instance's secrets, nothing lands in the checkout, `/` answers,
the admin's links and progress bars, the health page, and the deployment files."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import environ
import pytest
import yaml
from django.conf import settings
from django.urls import reverse

from relay import embedded

ROOT = Path(__file__).resolve().parent.parent


# --- .env.example ------------------------------------------------------------------------------


def test_env_example_parses_with_django_environ(tmp_path):
    class Env(environ.Env):
        ENVIRON = {}

    Env.read_env(ROOT / ".env.example", overwrite=True)
    values = Env.ENVIRON
    assert values, "nothing read"
    for name, value in values.items():
        assert "#" not in value, f"{name}={value!r}: an inline comment became part of the value"
    env = Env()
    for name in ("RELAY_MAX_REQUEST_BYTES", "RELAY_BATCH_MAX_ITEMS", "RELAY_MAX_UPLOAD_BYTES", "DB_CONN_MAX_AGE"):
        env.int(name)
    assert env.bool("DEBUG") is False
    env.db("DATABASE_URL")
    # Every variable it lists is one the relay reads.
    sources = "".join(p.read_text() for p in (ROOT / "relay").glob("*.py"))
    sources += (ROOT / "compose.yaml").read_text()  # FLOWER_BASIC_AUTH
    for name in values:
        assert f'"{name}"' in sources or f"${{{name}" in sources, f"{name} is in .env.example but nothing reads it"


# --- the launcher (make run) -------------------------------------------------------------------

# A child that ignores SIGTERM and has a grandchild: what a stuck gunicorn master with a worker looks like.
STUBBORN = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
    "print(g.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purpose.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _spawn_stubborn(children):
    proc = subprocess.Popen(
        [sys.executable, "-c", STUBBORN], env=children.env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    children.procs.append(proc)
    return proc, int(proc.stdout.readline())


@pytest.mark.e2e
def test_stop_ends_the_whole_tree_even_when_a_child_ignores_sigterm():
    children = embedded.Children(dict(os.environ), grace_seconds=0.5)
    proc, grandchild = _spawn_stubborn(children)
    polite = children.spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
    children.stop()
    assert proc.poll() is not None and polite.poll() is not None
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild), "a grandchild outlived the launcher"
    children.stop()  # a second stop (another Ctrl-C) is harmless


@pytest.mark.e2e
def test_a_failed_start_stops_what_it_had_started():
    with pytest.raises(subprocess.CalledProcessError), embedded.Children(dict(os.environ), grace_seconds=5) as kids:
        redis_like = kids.spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
        subprocess.run([sys.executable, "-c", "raise SystemExit(3)"], check=True)  # like a failing migrate
    assert redis_like.poll() is not None


@pytest.mark.e2e
def test_children_do_not_get_the_terminals_ctrl_c():
    """Each child leads its own session: a Ctrl-C reaches the launcher only, which then stops them once."""
    with embedded.Children(dict(os.environ), grace_seconds=5) as kids:
        proc = kids.spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
        assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)
        os.killpg(os.getpgid(0), 0)  # our own group is untouched by the children
    assert proc.returncode == -signal.SIGTERM


def test_embedded_env_carries_the_generated_secrets(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded, "STATE_DIR", tmp_path)
    (tmp_path / "secrets.env").write_text("SECRET_KEY=s1\nRELAY_MASTER_KEY=m1\nRELAY_ADMIN_TOKEN=t1\n")
    env = embedded.embedded_env({"PATH": "/bin"})
    assert env["RELAY_MASTER_KEY"] == "m1" and env["SECRET_KEY"] == "s1" and env["RELAY_EMBEDDED"] == "1"
    assert env["REDIS_URL"] == "redis://127.0.0.1:6390/0"
    assert env["RELAY_BATCH_PAYLOAD_DIR"] == str(tmp_path / "payloads")


def test_the_wrapper_runs_manage_and_celery_with_the_embedded_env(tmp_path, monkeypatch):
    """`scripts/embedded.sh manage.py …` (make manage) and `… celery …` (make flower)."""
    monkeypatch.setattr(embedded, "STATE_DIR", tmp_path)
    (tmp_path / "secrets.env").write_text("SECRET_KEY=s1\nRELAY_MASTER_KEY=m1\nRELAY_ADMIN_TOKEN=t1\n")
    monkeypatch.delenv("RELAY_MASTER_KEY", raising=False)
    calls = []
    monkeypatch.setattr(embedded.os, "execvpe", lambda file, argv, env: calls.append((argv, env)))
    embedded.exec_embedded(["manage.py", "relay", "apply", "catalog.yaml"])
    embedded.exec_embedded(["celery", "-A", "relay", "flower"])
    (manage_argv, env), (celery_argv, _) = calls
    assert manage_argv == [sys.executable, "manage.py", "relay", "apply", "catalog.yaml"]
    assert celery_argv == [sys.executable, "-m", "celery", "-A", "relay", "flower"]
    assert env["RELAY_MASTER_KEY"] == "m1" and env["RELAY_EMBEDDED"] == "1"


# --- nothing in the checkout -----------------------------------------------------------------------


def test_payloads_and_beat_state_are_outside_the_checkout():
    assert not Path(settings.RELAY_BATCH_PAYLOAD_DIR).resolve().is_relative_to(ROOT), (
        "tests write payloads into the repository: run them with `make test` / scripts/test.sh"
    )
    assert not Path(settings.CELERY_BEAT_SCHEDULE_FILENAME).resolve().is_relative_to(ROOT)


def test_dockerignore_keeps_secrets_and_state_out_of_the_image():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".env", ".venv", ".relay-embedded", "relay-batch-payloads", ".git"} <= ignored


def test_compose_protects_flower_and_keeps_redis_and_restarts():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    flower = services["flower"]
    assert any("--basic-auth" in str(part) for part in flower["command"])
    assert "FLOWER_BASIC_AUTH" in str(flower["command"])
    assert "redisdata" in compose["volumes"] and any("redisdata:" in v for v in services["redis"]["volumes"])
    for name in ("postgres", "redis", "web", "worker", "beat", "flower"):
        assert services[name].get("restart") == "unless-stopped", name


# --- pages -----------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_root_answers_a_landing_page(client):
    resp = client.get("/")
    assert resp.status_code == 200 and b"/api/docs/" in resp.content and b"/admin/" in resp.content


@pytest.fixture
def staff_client(client, django_user_model):
    client.force_login(django_user_model.objects.create_superuser("root", "root@example.com", "pw"))
    return client


@pytest.mark.django_db
def test_health_page_shows_queues_workers_and_breakers(staff_client, catalog):
    from core.crypto import sha256_hex
    from policies import breaker

    breaker.record_failure(sha256_hex("upstream-openai-1")[:12], breaker.Failure.AUTH)
    page = staff_client.get(reverse("admin-health")).content.decode()
    for text in ("Queues", "batch", "Workers seen by Celery", "Circuit breakers", "openai-1", "upstream_auth_failed"):
        assert text in page, text
    assert "upstream-openai-1" not in page  # a key's value is never shown
    assert reverse("admin-health") in staff_client.get("/admin/").content.decode()  # linked from the index


@pytest.mark.django_db
def test_health_page_is_for_staff_only(client):
    resp = client.get(reverse("admin-health"))
    assert resp.status_code == 302 and "/admin/login/" in resp["Location"]


@pytest.mark.django_db
def test_browse_all_items_link_lands_on_the_batch_items(staff_client, catalog):
    import io
    import json

    from batches.surfaces.native import submit
    from core import auth

    body = {"shape": "openai", "requests": [{"model": "gpt-4o", "messages": []}] * 3}
    batch = submit.submit_native(auth._principal_from_key(catalog.key), io.BytesIO(json.dumps(body).encode()))
    page = staff_client.get(reverse("admin:batches_batch_change", args=[batch.pk])).content.decode()
    href = f"{reverse('admin:batches_item_changelist')}?batch__id__exact={batch.pk}"
    assert f'href="{href}"' in page
    listing = staff_client.get(href)
    assert listing.status_code == 200 and "3 items" in listing.content.decode()
    assert 'class="relay-progress"' in staff_client.get(reverse("admin:batches_batch_changelist")).content.decode()


@pytest.mark.django_db(transaction=True)
def test_health_page_tells_thread_slots_from_pool_processes(workers):
    """The item worker's slots are threads (relay/processes.py), the control worker's are processes:
    what Celery's broadcast answers, as the health page shows it."""
    from relay.operator import celery_workers
    from tests.workers import wait_for

    workers("pools")
    seen: dict = {}

    def answered():
        seen.update({w["name"].split("@")[0]: w for w in celery_workers()[0]})
        return "items-pools" in seen and "control-pools" in seen

    wait_for(answered, 30, what="both workers to answer the broadcast")
    assert seen["items-pools"]["concurrency"] == 8
    assert seen["items-pools"]["pool"].startswith("threads (")
    assert seen["control-pools"]["concurrency"] == 4
    assert seen["control-pools"]["pool"] == "4 processes"
