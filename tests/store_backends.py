"""Every DirectoryStore backend, for the shared behavioural suite (tests/test_index.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvloop.clients.fleet.redis_local import local_redis
from kvloop.daemon.index import DirectoryStore, IndexConfig, MemoryStore
from kvloop.daemon.index.redis_store import RedisStore

BACKENDS = ["memory", "redis"]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> Iterator[str]:
    """One real redis-server (from PATH) for the session; each store flushes its database."""
    with local_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url


async def open_store(backend: str, config: IndexConfig, request: pytest.FixtureRequest) -> DirectoryStore:
    if backend == "memory":
        return MemoryStore(config)
    store = await RedisStore.connect(request.getfixturevalue("redis_url"), config)
    await store.flush()
    return store
