"""Limits, breakers and key-pool cursors are shared by separate OS processes.

A peer process (a fresh interpreter with its own Django set-up, Redis and
database connections) runs snippets sent from the tests, so one check can act in
one process and look from the other, both ways. The peer lives for the whole
module: starting Django costs about a second. The rate-limit test
commits its rows (transaction=True) so the peer can read the rules."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
from django.conf import settings
from django.db import connection

from core.redis import get_redis
from policies import breaker, keypool
from policies.breaker import Failure
from policies.ratelimit import RateLimited, reserve
from tests import factories

ROOT = Path(__file__).resolve().parent.parent

# Runs each line of stdin (a JSON string of Python code) and answers with one
# JSON line: what the code printed, or its traceback.
PEER = """
import contextlib, io, json, sys, traceback
import django
django.setup()
from policies import breaker, keypool
from policies.breaker import Failure
from policies.models import RateLimit
from policies.ratelimit import RateLimited, reserve
for line in sys.stdin:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(json.loads(line), globals())
        reply = {"out": out.getvalue().strip(), "error": None}
    except Exception:
        reply = {"out": out.getvalue(), "error": traceback.format_exc()}
    print(json.dumps(reply), flush=True)
"""


class Peer:
    def __init__(self, env: dict):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PEER], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def send(self, code: str) -> None:
        self.proc.stdin.write(json.dumps(textwrap.dedent(code)) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> str:
        line = self.proc.stdout.readline()
        assert line, f"peer exited with {self.proc.wait()}"
        reply = json.loads(line)
        assert reply["error"] is None, reply["error"]
        return reply["out"]

    def run(self, code: str) -> str:
        self.send(code)
        return self.receive()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def peer(django_db_setup):
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="relay.settings", REDIS_URL=settings.REDIS_URL)
    # The peer must read the test database, not the one DATABASE_URL names.
    url = urlsplit(env["DATABASE_URL"])
    env["DATABASE_URL"] = url._replace(path="/" + connection.settings_dict["NAME"]).geturl()
    started = Peer(env)
    yield started
    started.close()


@pytest.mark.django_db(transaction=True, available_apps=["policies"])
def test_a_limit_spent_in_another_process_is_spent_here_and_back(peer):
    rl = factories.rate_limit("shared", ("requests", 2, 60, "token-bucket"))
    out = peer.run(f"""
        rl = RateLimit.objects.get(pk={rl.pk})
        for _ in range(2):
            reserve("policy:1", rl, subject="policy shared")
        print("spent")
    """)
    assert out == "spent"
    with pytest.raises(RateLimited):
        reserve("policy:1", rl, subject="policy shared")

    # The other way round, with a gauge held here and refused over there.
    gauge = factories.rate_limit("gauge", ("concurrency", 1, 60, "sliding-window"))
    held = reserve("policy:2", gauge, subject="policy gauge")
    attempt = f"""
        try:
            reserve("policy:2", RateLimit.objects.get(pk={gauge.pk}), subject="policy gauge").release()
            print("allowed")
        except RateLimited as exc:
            print(exc.meter)
    """
    assert peer.run(attempt) == "concurrency"
    held.release()
    assert peer.run(attempt) == "allowed"


def test_a_breaker_opened_elsewhere_is_open_here_and_back(peer):
    out = peer.run("""
        breaker.record_failure("k-peer", Failure.AUTH)
        print(breaker.snapshot("k-peer")["state"])
    """)
    assert out == "open"
    assert not breaker.try_acquire("k-peer")
    assert breaker.snapshot("k-peer")["reason"] == "upstream_auth_failed"

    breaker.record_failure("k-here", Failure.SERVER)
    assert peer.run('print(breaker.try_acquire("k-here"), breaker.snapshot("k-here")["step"])') == "False 1"
    breaker.record_success("k-here")
    assert peer.run('print(breaker.try_acquire("k-here"))') == "True"


def test_only_one_process_gets_the_half_open_probe(peer):
    for _ in range(5):
        breaker.record_failure("k", Failure.SERVER)
        # End the cooldown now rather than waiting for it.
        get_redis().hset("relay:breaker:{k}", "open_until", 0)
        # The peer and this process race for the probe, then both ask again.
        peer.send('print(breaker.try_acquire("k"), breaker.try_acquire("k"))')
        here = [breaker.try_acquire("k"), breaker.try_acquire("k")]
        there = [answer == "True" for answer in peer.receive().split()]
        assert (here + there).count(True) == 1
        breaker.record_success("k")


def test_key_pool_cursors_are_shared(peer):
    peer.run("""
        from types import SimpleNamespace
        pool = [SimpleNamespace(key_hash=h) for h in ("a", "b", "c")]
    """)
    rr = 'print(",".join(c.key_hash for c in keypool.order(5, "round-robin", pool)))'
    assert peer.run(rr) == "a,b,c"
    pool = [SimpleNamespace(key_hash=h) for h in ("a", "b", "c")]
    assert [c.key_hash for c in keypool.order(5, "round-robin", pool)] == ["b", "c", "a"]
    assert peer.run(rr) == "c,a,b"

    # Least-recently-used: a key picked in another process goes to the back here.
    peer.run('keypool.mark_used(5, "a")')
    assert [c.key_hash for c in keypool.order(5, "least-recently-used", pool)] == ["b", "c", "a"]
