"""The one home of the Redis Lua scripts' plumbing: a server-time prelude and a runner.

Every script of breaker, key pool and rate limit starts with `NOW_MS` (Redis server
time in ms, so processes on machines with skewed clocks agree) and runs through
`run()`: redis-py hashes each source once per client and then calls it by SHA
(EVALSHA, falling back to EVAL after a SCRIPT FLUSH or a Redis restart).
"""

from __future__ import annotations

from functools import lru_cache

import redis
from redis.commands.core import Script

from relay.redis import get_redis

NOW_MS = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""


@lru_cache(maxsize=32)
def script(client: redis.Redis, source: str) -> Script:
    return client.register_script(source)


def run(source: str, keys: list, args: list):
    """One round trip: the script `source` with `keys` and `args`."""
    client = get_redis()
    return script(client, source)(keys=keys, args=args, client=client)
