"""The block directory on Redis (>= 7.0, or Valkey): several kvloopd processes can share it.

Every call that reads and changes the directory is one Redis Function of ``directory.lua`` (loaded
with FUNCTION LOAD REPLACE at start), so it is atomic however many replicas call it, and it is
replicated and persisted with the data. The layout is described there. What stays in this process
is only a cache of worker specs keyed by (worker, epoch), which never change under one epoch.

Times are wall-clock seconds (``time.time``): replicas on different hosts must agree on them
(NTP), where the in-memory store can use its own monotonic clock.

Where it differs from the in-memory store, by design:
* keys are hash-tagged per model, not per (model, LoRA): a worker's fence and liveness are read by
  the same function that changes or looks up its blocks, and one worker serves several LoRAs of its
  model; so a model is one slot (one shard in a Cluster), and ``max_entries`` bounds each model;
* ``connected`` is a liveness key with a PX expiry of one lease, refreshed by every message, so a
  replica that dies with streams attached does not leave their workers "connected" for good.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.asyncio.sentinel import SentinelConnectionPool

from kvloop.common.block_keys import KEY_BYTES
from kvloop.daemon.index import redis_wire as wire
from kvloop.daemon.index.model import (
    Change,
    Cleared,
    Event,
    Location,
    Namespace,
    PrefixMatch,
    Released,
    Removed,
    Retained,
    Stored,
    WorkerSpec,
)
from kvloop.daemon.index.redis_registry import SlotRegistry
from kvloop.daemon.index.store import Applied, Fence, IndexConfig, StoreCounts

log = structlog.get_logger("kvloop.daemon")

# How long a call waits for one of the pool's connections when all are busy.
POOL_WAIT_S = 2.0
# Connections per kvloopd process kept for Lookups beyond the pool (see _DirectLane).
LANE_CONNECTIONS = 32


@functools.lru_cache(maxsize=4096)
def _namespace(namespace: Namespace) -> tuple[str, str]:
    base = wire.model_base(namespace.model)
    return base, f"{base}{namespace.lora_name.encode().hex()}:"


class _DirectLane:
    """Connections of the store's pool kept checked out for the hot read-modify function (a Lookup).

    A call through redis-py's client checks a connection out of the blocking pool (an asyncio
    condition and lock) and wraps it in its retry and response-callback layers, a sizeable share of a
    Lookup's whole store round trip. Here a call takes an idle connection from a list, sends, reads
    and puts it back. Any failure hands the call to the ordinary client path (its retries, Sentinel's
    reconnection); the connection that failed is closed and dropped. Only functions that write may use
    the lane: a primary demoted to a replica refuses them (READONLY), so a connection left on an old
    primary can never answer from its stale data; and once Sentinel's pool has found a new primary,
    an idle connection to the old one is closed when next taken.

    The connections are made by the pool's own connection class (TLS, ACL user, Sentinel's primary
    discovery), up to ``size`` beyond the pool's; a call that finds none idle at the cap takes the
    ordinary path."""

    def __init__(self, client: aioredis.Redis, size: int) -> None:
        self._pool = client.connection_pool
        kwargs = self._pool.connection_kwargs
        # The call's deadline is one asyncio.timeout around the send and the reply: redis-py's own
        # socket timeout wraps every send in asyncio.wait_for, a task and a loop turn more per call.
        self.timeout_s = kwargs.get("socket_timeout") or None
        self._kwargs = {**kwargs, "socket_timeout": None}
        self._idle: list[Any] = []
        self._open = 0
        self._size = size

    async def take(self) -> Any | None:
        # Sentinel's pool records the primary it last found; an idle connection to another one
        # (found before a failover) is closed, as the pool closes its own idle ones.
        primary = getattr(self._pool, "master_address", None)
        while self._idle:
            connection = self._idle.pop()
            if primary is None or (connection.host, connection.port) == tuple(primary):
                return connection
            await self.drop(connection)
        if self._open >= self._size:
            return None
        self._open += 1
        return self._pool.connection_class(**self._kwargs)

    def give_back(self, connection: Any) -> None:
        self._idle.append(connection)

    async def drop(self, connection: Any) -> None:
        self._open -= 1
        await connection.disconnect(nowait=True)

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            await self.drop(connection)


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """The primary Sentinel names, through a pool whose calls wait for a free connection (as
    ``RedisStore.connect``'s) instead of failing at once when all are busy."""


class RedisStore:
    """The DirectoryStore on a Redis server shared by any number of kvloopd replicas."""

    name = "redis"
    in_process = False
    epoch: int
    clock = staticmethod(time.time)  # wall time: replicas on different hosts agree on it (NTP)

    def __init__(self, client: Any, config: IndexConfig | None = None) -> None:
        self.config = config or IndexConfig()
        self._r = client
        self._lane = _DirectLane(client, LANE_CONNECTIONS)
        registry = self._registry = SlotRegistry(client, self.config, self._fcall)
        # What the worker registry answers alone: all it reads and writes is in the model's slot.
        self.disconnect = wire.reachable(registry.disconnect)
        self.heartbeat = wire.reachable(registry.heartbeat)
        self.last_sequence = wire.reachable(registry.last_sequence)
        self.worker_spec = wire.reachable(registry.worker_spec)
        self.model_spec = wire.reachable(registry.model_spec)
        self.mark_resyncing = wire.reachable(registry.mark_resyncing)
        self.set_draining = wire.reachable(registry.set_draining)
        self.set_unverified = wire.reachable(registry.set_unverified)
        self.workers = wire.reachable(registry.workers)
        self.models = wire.reachable(registry.models)
        self._sentinel: tuple[Any, str] | None = None
        # The directory epoch answers are minted under: Sentinel's config epoch + 1 (a fresh Sentinel
        # reports 0; 0 stays "cannot fail over", as without Sentinel), and the primary's address it
        # was checked against.
        self.epoch = 0
        self._checked_primary: Any = None
        self._pending_changes: list[Change] = []  # found outside reap (a lookup saw the failover)

    @classmethod
    async def connect(cls, url: str, config: IndexConfig | None = None, **options: Any) -> RedisStore:
        """Connect (``redis://``, ``rediss://`` for TLS, ``unix://``) and load the function library.

        ``options`` go to redis-py (username, password, ssl_ca_certs...), so credentials need not be in
        the URL; neither is ever logged."""
        # redis-py's default asyncio pool refuses a call at once when its 100 connections are busy
        # ("Too many connections"); under load (many agent streams and Lookups at once) that answered
        # UNAVAILABLE. A blocking pool makes such a call wait for a connection instead.
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=wire.POOL_CONNECTIONS, timeout=POOL_WAIT_S, **options
        )
        client = aioredis.Redis.from_pool(pool)
        try:
            await client.function_load(wire.LIBRARY, replace=True)
        except Exception:
            await client.aclose()
            raise
        log.info("directory store on redis", url=wire.redacted(url))
        return cls(client, config)

    @classmethod
    async def connect_sentinel(
        cls,
        sentinels: Sequence[str],
        master: str,
        url: str = "redis:///0",
        config: IndexConfig | None = None,
        master_wait_s: float = 15.0,
        **options: Any,
    ) -> RedisStore:
        """Connect to the primary that ``sentinels`` elect for ``master``, following failovers.

        ``url`` gives the database and TLS (rediss:///0); its host is ignored. Waits up to
        ``master_wait_s`` for the sentinels to name a primary."""
        from urllib.parse import urlsplit

        from redis.asyncio.sentinel import MasterNotFoundError, Sentinel

        parts = urlsplit(url)
        db = int(parts.path.strip("/") or 0) if parts.scheme in ("redis", "rediss") else 0
        if parts.scheme == "rediss":
            options["ssl"] = True
        addresses = [(h, int(p)) for h, _, p in (a.rpartition(":") for a in sentinels)]
        sentinel = Sentinel(addresses, socket_timeout=2.0, **options)
        client = sentinel.master_for(
            master,
            connection_pool_class=_BlockingSentinelPool,
            max_connections=wire.POOL_CONNECTIONS,
            timeout=POOL_WAIT_S,
            db=db,
            socket_timeout=2.0,
        )
        # No primary yet is an answer Sentinel gives while it fails over, or when none of them answered
        # in time (a busy host): ask again for a while before giving up.
        deadline = time.monotonic() + master_wait_s
        while True:
            try:
                await client.function_load(wire.LIBRARY, replace=True)
                break
            except MasterNotFoundError as exc:
                if time.monotonic() < deadline:
                    log.warning("no redis primary from the sentinels yet; asking again", error=str(exc)[:200])
                    await asyncio.sleep(0.5)
                    continue
                await client.aclose()
                raise
            except Exception:
                await client.aclose()
                raise
        log.info("directory store on redis via sentinel", sentinels=list(sentinels), master=master, db=db)
        store = cls(client, config)
        store._sentinel = (sentinel, master)
        await store._check_epoch()  # record the epoch before this replica writes anything
        return store

    async def directory_epoch(self) -> int | None:
        """Sentinel's config epoch of the primary (it grows with each failover a quorum agreed on),
        the highest any reachable sentinel reports; None without Sentinel or when none answers."""
        if self._sentinel is None:
            return None
        sentinel, master = self._sentinel
        epochs = []
        for node in sentinel.sentinels:
            try:
                epochs.append(int((await node.sentinel_master(master))["config-epoch"]))
            except Exception:  # a sentinel that is down or does not know the master: ask the others
                continue
        return max(epochs) if epochs else None

    def change_relay(self) -> wire.RedisChangeRelay:
        return wire.RedisChangeRelay(self._r)

    def plan_relay(self) -> wire.RedisChangeRelay:
        return wire.RedisChangeRelay.of_plans(self._r)

    async def close(self) -> None:
        await self._registry.close()
        await self._lane.close()
        await self._r.aclose()

    async def flush(self) -> None:
        """Drop every key of this store's database (tests, benchmarks)."""
        await self._r.flushdb()

    # ---- calls -------------------------------------------------------------------------------

    async def _fcall_direct(self, function: str, keys: Sequence[str], *args: Any) -> Any:
        """``_fcall`` through the lane, for a function that writes (see _DirectLane)."""
        lane = self._lane
        connection = await lane.take()
        if connection is None:
            return await self._fcall(function, keys, *args)
        reply = await wire.exchange(
            connection, function, keys, args, lane.timeout_s, lane.give_back, lane.drop
        )
        if reply is not wire.CLIENT_WAY:
            return reply
        return await self._fcall(function, keys, *args)  # reloads the library, retries, follows Sentinel

    async def _fcall(self, function: str, keys: Sequence[str], *args: Any) -> Any:
        return await wire.fcall(self._r, function, keys, *args)

    # ---- worker registry ---------------------------------------------------------------------

    @wire.reachable
    async def register(self, spec: WorkerSpec, last_sequence: int, now: float) -> tuple[int, bool]:
        reply = await self._registry.register_call(spec, last_sequence, now)
        return self._registry.registered(spec, reply)

    # ---- failover ----------------------------------------------------------------------------

    async def _check_epoch(self) -> list[Change]:
        """After a failover the new primary may lack writes the old one acknowledged (replication is
        asynchronous): a freed run could look retained. So when Sentinel's epoch moves past the one
        recorded with the data, every worker is marked resyncing (not served) until its agent has
        re-pushed its state; exactly one replica wins the compare-and-set and reports the change
        ("failover", relayed to the other replicas).

        A replica also reports "primary_moved" when it reconnected to another primary or saw the epoch
        move without winning: what it wrote meanwhile may have gone to a primary being demoted (a starved
        primary is failed over while it still accepts writes), and the winner's relayed change may have
        been published where this replica was not listening, so it asks its own agents again."""
        epoch = await self.directory_epoch()
        if epoch is None:
            return []
        primary = self._primary()
        moved = self._checked_primary is not None and primary != self._checked_primary
        self._checked_primary = primary
        bases = await self._registry.bases()
        previous = await self._fcall("kvl_epoch", [wire.EPOCH], epoch, *bases.values())
        known, self.epoch = self.epoch, max(self.epoch, epoch + 1)
        log.debug("directory epoch checked", epoch=epoch, previous=previous)
        if previous is not None and int(previous) >= 0:
            log.warning("redis failover: every worker must resync", epoch=epoch, previous_epoch=int(previous))
            detail = f"directory epoch {int(previous)} -> {epoch}: resync required"
            return [Change("failover", "", "", 0, detail)]
        if moved or (known and self.epoch > known):
            log.warning("redis primary moved: this replica's agents resync", epoch=epoch, primary=primary)
            return [Change("primary_moved", "", "", 0, f"the directory's primary moved (epoch {epoch})")]
        return []

    def _primary(self) -> Any:
        """The primary's address redis-py's Sentinel pool last connected to."""
        return getattr(self._r.connection_pool, "master_address", None)

    def _primary_moved(self) -> bool:
        """The client reconnected to another primary since the epoch was last checked (cheap: the
        address redis-py's Sentinel pool connected to)."""
        return self._sentinel is not None and self._primary() != self._checked_primary

    @wire.reachable
    async def reap(self, now: float) -> list[Change]:
        changes: list[Change] = [*self._pending_changes, *await self._check_epoch()]
        self._pending_changes.clear()
        for model, base in sorted((await self._registry.bases()).items()):
            reply = await self._fcall(
                "kvl_reap",
                [f"{base}exp"],
                base,
                repr(now),
                repr(self.config.lease_s),
                repr(self.config.drop_after_s),
            )
            reaped = wire.reap_changes(model, reply)
            if any(change.kind == "dropped" for change in reaped):
                self._registry.forget_model(model)
            changes.extend(reaped)
        return changes

    # ---- block index -------------------------------------------------------------------------

    @wire.reachable
    async def apply(
        self, worker_id: str, epoch: int, sequence: int, events: Sequence[Event], now: float
    ) -> Applied:
        spec = await self._registry.spec_at(worker_id, epoch)
        if spec is None:
            return Applied(Fence.UNKNOWN_WORKER, 0)
        base = wire.model_base(spec.model)
        args: list[Any] = [
            base,
            worker_id,
            str(epoch),
            sequence,
            repr(now),
            self._registry.lease_ms,
            self.config.max_entries,
        ]
        model = spec.model
        for event in events:
            kind = type(event)
            if kind is Retained or kind is Stored or kind is Removed:
                assert isinstance(event, (Retained, Stored, Removed))
                args += wire.block_event_args(_namespace(Namespace(model, event.lora_name))[1], event)
            elif kind is Released:
                assert isinstance(event, Released)
                args += ["L", event.handle]
            elif kind is Cleared:
                args.append("C")
        status, last, touched = await self._fcall("kvl_apply", [f"{base}w:{worker_id}"], *args)
        return Applied(Fence(wire.text(status)), int(last), int(touched))

    @wire.reachable
    async def begin_snapshot(self, worker_id: str, now: float) -> None:
        await self._registry.snapshot(worker_id, "begin", now)

    @wire.reachable
    async def end_snapshot(self, worker_id: str, sequence: int, now: float) -> None:
        await self._registry.snapshot(worker_id, "end", now, sequence)

    @wire.reachable
    async def lookup(
        self,
        namespace: Namespace,
        hashes: Sequence[bytes],
        local_blocks: int,
        requester: str,
        now: float,
        claim: bool,
        *,
        margin_s: float = 0.0,
        accept: Callable[[WorkerSpec], bool] | None = None,
    ) -> PrefixMatch:
        if local_blocks >= len(hashes):
            return PrefixMatch(None, [])
        base, prefix = _namespace(namespace)
        floor = now + max(self.config.expiry_margin_s, margin_s)
        packed = wire.key_bytes(hashes)
        width = KEY_BYTES
        excluded: list[str] = []
        # The layout check is the caller's code: the function picks a holder, and one this puller
        # cannot read is excluded and the search repeated (rare: most fleets share one layout).
        while True:
            if self._primary_moved():
                # A new primary answers from here on, and the periodic check may not have run yet:
                # reconcile the epoch first (marks every worker resyncing on a failover), so no
                # answer comes from data the old primary had moved past.
                self._pending_changes.extend(await self._check_epoch())
            reply = await self._fcall_direct(
                "kvl_lookup",
                [f"{prefix}ret"],
                base,
                prefix,
                packed,
                width,
                local_blocks,
                requester,
                repr(now),
                repr(floor),
                repr(self.config.lease_s),
                int(claim),
                "\n".join(excluded),
            )
            if self._primary_moved():
                continue  # the call itself reconnected to a new primary: ask again after the check
            answer = await self._registry.answer(base, reply, accept)
            if isinstance(answer, PrefixMatch):
                return answer
            if claim and answer.claimed:  # a single-use run is claimed as it is answered
                await self.release_claim(namespace, answer.worker_id, answer.handle, requester)
            excluded.append(answer.worker_id)

    @wire.reachable
    async def stored_prefixes(
        self, namespace: Namespace, hashes: Sequence[bytes], workers: Sequence[str], now: float
    ) -> dict[str, int]:
        if not workers or not hashes:
            return dict.fromkeys(workers, 0)
        base, prefix = _namespace(namespace)
        reply = await self._fcall(
            "kvl_stored_prefixes",
            [f"{prefix}sto"],
            base,
            wire.key_bytes(hashes),
            KEY_BYTES,
            repr(now),
            repr(self.config.lease_s),
            *workers,
        )
        return {w: int(n) for w, n in zip(workers, reply, strict=True)}

    @wire.reachable
    async def release_claim(self, namespace: Namespace, holder: str, handle: str, requester: str) -> bool:
        base, prefix = _namespace(namespace)
        return bool(
            await self._fcall("kvl_release", [f"{base}wr:{holder}"], base, prefix, holder, handle, requester)
        )

    @wire.reachable
    async def find(self, namespace: Namespace, block_hash: bytes, now: float) -> list[Location]:
        base, prefix = _namespace(namespace)
        reply = await self._fcall(
            "kvl_find",
            [f"{prefix}ret"],
            base,
            prefix,
            wire.key_bytes([block_hash]),
            repr(now),
            repr(now + self.config.expiry_margin_s),
            repr(self.config.lease_s),
        )
        return wire.locations(reply)

    @wire.reachable
    async def counts(self) -> StoreCounts:
        return wire.store_counts(
            [await self._r.hgetall(f"{base}stats") for base in (await self._registry.bases()).values()]
        )
