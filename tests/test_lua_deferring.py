"""policies.lua: scripts held back in a `deferring` block travel with the thread's next command (a batch
slot's success settle with the next item's key pick), against a real Redis."""

import logging

import pytest

from core.redis import get_redis
from policies import lua
from tests.test_query_counts import redis_round_trips

pytestmark = pytest.mark.integration  # Redis

INCR = "return redis.call('INCRBY', KEYS[1], ARGV[1])"
GET = "return redis.call('GET', KEYS[1])"
FAIL = "return redis.error_reply('boom')"


def test_outside_a_block_run_later_runs_at_once():
    lua.run_later(INCR, ["n"], [2])
    assert get_redis().get("n") == "2"


def test_held_back_scripts_go_with_the_next_command_in_one_round_trip(monkeypatch):
    lua.run(GET, ["n"], [])  # the scripts are known to the server: what is counted is the steady state
    seen = []

    def block():
        with lua.deferring():
            lua.run_later(INCR, ["n"], [2])
            lua.run_later(INCR, ["n"], [3])
            seen.append(get_redis().get("n"))  # nothing sent yet (this GET is a round trip of its own)
            seen.append(lua.run(GET, ["n"], []))  # the held-back ones ran first, in order, in its round trip
            seen.append(lua.run(GET, ["n"], []))  # sent once only

    assert redis_round_trips(block, monkeypatch) == 3  # and nothing more at the block's end
    assert seen == [None, "5", "5"]


def test_the_block_end_sends_what_is_still_held_back():
    with lua.deferring():
        lua.run_later(INCR, ["n"], [7])
        with lua.deferring():  # nested: the outer block owns the flush
            lua.run_later(INCR, ["n"], [1])
        assert get_redis().get("n") is None
    assert get_redis().get("n") == "8"


def test_a_failing_deferred_script_is_logged_not_raised_into_the_next_command(caplog):
    with caplog.at_level(logging.WARNING, logger="policies.lua"), lua.deferring():
        lua.run_later(FAIL, [], [])
        lua.run_later(INCR, ["n"], [1])
        assert lua.run(GET, ["n"], []) == "1"
        lua.run_later(FAIL, [], [])
    assert sum("deferred Redis script failed" in r.getMessage() for r in caplog.records) == 2


def test_the_command_itself_still_raises():
    import redis

    with lua.deferring():
        lua.run_later(INCR, ["n"], [1])
        with pytest.raises(redis.ResponseError, match="boom"):
            lua.run(FAIL, [], [])
    assert get_redis().get("n") == "1"


def test_scripts_unknown_to_the_server_are_loaded_and_run_once():
    r = get_redis()
    lua.run(INCR, ["n"], [1])
    r.script_flush()  # as a restarted Redis: no script is known
    with lua.deferring():
        lua.run_later(INCR, ["n"], [10])
        assert lua.run(GET, ["n"], []) in ("11", "1")  # the reloaded settle may run after it
    assert r.get("n") == "11"
    assert lua.run(GET, ["n"], []) == "11"
