"""Every DirectoryStore backend, for the shared behavioural suite (tests/test_index.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvloop.clients.fleet.redis_local import local_redis, local_redis_cluster
from kvloop.daemon.index import DirectoryStore, IndexConfig, MemoryStore
from kvloop.daemon.index.redis_cluster_store import RedisClusterStore
from kvloop.daemon.index.redis_store import RedisStore

BACKENDS = ["memory", "redis", "redis-cluster"]
# Buckets per model on the cluster: more than its primaries, so a test's conversations spread.
CLUSTER_BUCKETS = 16


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> Iterator[str]:
    """One real redis-server (from PATH) for the session; each store flushes its database."""
    with local_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory) -> Iterator[str]:
    """One real 3-primary Redis Cluster (redis-server and redis-cli from PATH) for the session."""
    with local_redis_cluster(tmp_path_factory.mktemp("redis-cluster"), primaries=3, replicas=0) as cluster:
        yield cluster.url


async def open_store(backend: str, config: IndexConfig, request: pytest.FixtureRequest) -> DirectoryStore:
    if backend == "memory":
        return MemoryStore(config)
    if backend == "redis-cluster":
        url = request.getfixturevalue("redis_cluster_url")
        cluster = await RedisClusterStore.connect_cluster(url, config, buckets=CLUSTER_BUCKETS)
        await cluster.flush()
        return cluster
    store = await RedisStore.connect(request.getfixturevalue("redis_url"), config)
    await store.flush()
    return store
