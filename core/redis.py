"""The one Redis client: shared state (limits, breakers, key-pool cursors)."""

from functools import lru_cache

import redis
from django.conf import settings


@lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=5, socket_connect_timeout=5)


def get_redis() -> redis.Redis:
    return _client(settings.REDIS_URL)
