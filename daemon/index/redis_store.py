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
import hashlib
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict
from importlib import resources
from typing import Any

import hiredis
import redis.asyncio as aioredis
import structlog
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvloop.common.block_keys import KEY_BYTES, block_keys, packed_keys
from kvloop.common.packed_ids import pack_u32, unpack_u32
from kvloop.daemon.index.model import (
    BlockTier,
    Change,
    Cleared,
    Event,
    Holding,
    LeaseState,
    Location,
    Namespace,
    PackedHashes,
    PrefixMatch,
    Released,
    Removed,
    Retained,
    Stored,
    WorkerSpec,
    WorkerView,
)
from kvloop.daemon.index.store import (
    Applied,
    DirectoryError,
    Fence,
    IndexConfig,
    StoreCounts,
    StoreUnavailable,
)

log = structlog.get_logger("kvloop.daemon")

LIBRARY = resources.files("kvloop.daemon.index").joinpath("directory.lua").read_text()
_PREFIX = "kvl"
_MODELS = f"{_PREFIX}:models"  # hash: model -> its key base (the only key outside a model's slot)
_EPOCH = f"{_PREFIX}:epoch"  # the Sentinel config epoch the data was last reconciled under
_LITTLE = sys.byteorder == "little"


def _keys(hashes: Sequence[bytes]) -> bytes:
    """The blocks' keys, concatenated (KEY_BYTES each: see kvloop.common.block_keys)."""
    if not hashes:
        return b""
    if isinstance(hashes, PackedHashes):
        return packed_keys(hashes.data, hashes.width)  # a Lookup's packed prompt: no walk per block
    return b"".join(block_keys(hashes))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _holding(spec: WorkerSpec, matched: int, entry: list) -> Holding:
    handle, expires_ms, ids, groups, single_use, tail_tokens, tail_blocks = entry[2:9]
    # the run's tier (absent from a library an older replica loaded: its runs are device runs)
    tier = entry[9] if len(entry) > 9 else BlockTier.DEVICE
    generation = entry[10] if len(entry) > 10 else 0
    return Holding(
        worker=spec,
        matched_blocks=matched,
        handle=_text(handle),
        expires_in_ms=int(expires_ms),
        packed_block_ids=bytes(ids),  # as Lua packed them: sent on as they are
        num_groups=int(groups),
        single_use=_text(single_use) == "1",
        tail_token_ids=unpack_u32(tail_tokens),
        tail_block_ids=unpack_u32(tail_blocks),
        tier=int(tier),
        registration_generation=int(generation),
    )


def _locations(reply: list) -> list[Location]:
    """kvl_find's answer."""
    found = []
    for entry in reply:
        if _text(entry[0]) == "stored":
            found.append(Location(_text(entry[1]), "stored", -1, [], "", 0, False, 0))
            continue
        _, worker, position, ids, handle, expires_ms, servable, tier = entry
        found.append(
            Location(
                worker_id=_text(worker),
                kind="retained",
                position=int(position),
                block_ids=list(unpack_u32(ids)),
                handle=_text(handle),
                expires_in_ms=int(expires_ms),
                servable=bool(servable),
                tier=int(tier),
            )
        )
    return found


def _changes(model: str, reply: Sequence[Sequence[Any]]) -> list[Change]:
    """A reaping function's answer (kind, worker, blocks, detail, and maybe more) as changes."""
    return [Change(_text(k), _text(w), model, int(b), _text(d)) for k, w, b, d, *_ in reply]


def _store_counts(stats: Sequence[dict]) -> StoreCounts:
    """The directory's counts, summed over the ``stats`` hashes it keeps (one per model, or per bucket
    on a cluster)."""
    totals = {"entries": 0, "runs": 0, "events": 0, "evictions": 0, "expired": 0}
    for fields in stats:
        for field, value in fields.items():
            if _text(field) in totals:
                totals[_text(field)] += int(value)
    return StoreCounts(
        entries=totals["entries"],
        retained_runs=totals["runs"],
        events_ingested=totals["events"],
        evictions=totals["evictions"],
        expired_runs=totals["expired"],
    )


def _spec_json(spec: WorkerSpec) -> str:
    return json.dumps(asdict(spec), separators=(",", ":"))


def _spec_from_json(raw: bytes | str) -> WorkerSpec:
    fields = json.loads(raw)
    fields["parallel"] = tuple(fields["parallel"])
    return WorkerSpec(**fields)


# Connections to Redis per kvloopd process, and how long a call waits for one when all are busy.
POOL_CONNECTIONS = 100
POOL_WAIT_S = 2.0
# Connections per kvloopd process kept for Lookups beyond the pool (see _DirectLane).
LANE_CONNECTIONS = 32
# A model's spec (its block layout), read on every Lookup: used as is up to MODEL_SPEC_FRESH_S old,
# used while a refresh runs beside the Lookup up to MODEL_SPEC_STALE_S old, fetched first beyond.
MODEL_SPEC_FRESH_S = 1.0
MODEL_SPEC_STALE_S = 30.0


def redacted(url: str) -> str:
    """The URL without its password, for logs."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _reachable(method: Callable) -> Callable:
    """Redis unreachable -> StoreUnavailable (the service answers UNAVAILABLE, never UNKNOWN)."""

    @functools.wraps(method)
    async def call(self: RedisStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return await method(self, *args, **kwargs)
        except (
            RedisConnectionError,
            RedisTimeoutError,
            ReadOnlyError,
            RedisClusterException,
            OSError,
        ) as exc:
            # RedisClusterException: a cluster with no reachable node, or a slot no node covers
            raise StoreUnavailable(
                f"the directory store (redis) is unreachable: {exc or type(exc).__name__}"
            ) from None

    return call


CLIENT_WAY = object()  # exchange's answer when the call must go through the client instead


async def exchange(
    connection: Any,
    function: str,
    keys: Sequence[str],
    args: Sequence[Any],
    timeout_s: float | None,
    keep: Callable[[Any], None],
    discard: Callable[[Any], Awaitable[None]],
    refused_before_running: tuple[type[Exception], ...] = (),
) -> Any:
    """FCALL sent on ``connection`` and its reply read, outside redis-py's client (the fast paths of
    both Redis stores). Returns the reply, or CLIENT_WAY when the call must take the client's way
    (which reloads a lost library, reconnects, follows redirections). ``keep`` takes the connection
    back after a reply, ``discard`` after a failure that left its stream out of step. An error reply
    is raised, unless the function was not found, or it is one of ``refused_before_running``
    (nothing was written: the client's way may send it again)."""
    try:
        async with asyncio.timeout(timeout_s):
            # hiredis packs the whole command in C: redis-py's packer encodes each argument in
            # Python first.
            await connection.send_packed_command(
                hiredis.pack_command(("FCALL", function, len(keys), *keys, *args)), check_health=False
            )
            reply = await connection.read_response()
    except refused_before_running:
        keep(connection)
    except ResponseError as exc:
        keep(connection)  # an error reply: the connection itself is fine
        if "function not found" not in str(exc).lower():
            raise
    except (RedisConnectionError, RedisTimeoutError, OSError):  # OSError: TimeoutError too
        await discard(connection)
    except BaseException:
        await discard(connection)  # cancelled mid-reply: its stream is out of step
        raise
    else:
        keep(connection)
        return reply
    return CLIENT_WAY


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

    def __init__(self, client: Any, config: IndexConfig | None = None, lane: bool = True) -> None:
        self.config = config or IndexConfig()
        self._r = client
        # A cluster client has no single pool to keep a lane in: its calls take the client's path.
        self._lane = _DirectLane(client, LANE_CONNECTIONS) if lane else None
        self._specs: dict[tuple[str, str], WorkerSpec] = {}  # (worker, epoch) -> spec
        self._model_specs: dict[str, tuple[float, WorkerSpec]] = {}  # model -> (fetched at, spec)
        self._spec_refreshes: dict[str, asyncio.Task] = {}  # model -> its refresh in the background
        self._model_of: dict[str, str] = {}  # worker -> model (a worker id keeps its model)
        self._lease_ms = str(max(1, int(self.config.lease_s * 1000)))
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
            url, max_connections=POOL_CONNECTIONS, timeout=POOL_WAIT_S, **options
        )
        client = aioredis.Redis.from_pool(pool)
        try:
            await client.function_load(LIBRARY, replace=True)
        except Exception:
            await client.aclose()
            raise
        log.info("directory store on redis", url=redacted(url))
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
            max_connections=POOL_CONNECTIONS,
            timeout=POOL_WAIT_S,
            db=db,
            socket_timeout=2.0,
        )
        # No primary yet is an answer Sentinel gives while it fails over, or when none of them answered
        # in time (a busy host): ask again for a while before giving up.
        deadline = time.monotonic() + master_wait_s
        while True:
            try:
                await client.function_load(LIBRARY, replace=True)
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

    def clock(self) -> float:
        return time.time()

    def change_relay(self) -> RedisChangeRelay:
        return RedisChangeRelay(self._r)

    def plan_relay(self) -> RedisChangeRelay:
        """Route's plans between replicas (daemon/plans.py), on a channel of their own."""
        return RedisChangeRelay(self._r, f"{_PREFIX}:plans")

    async def close(self) -> None:
        refreshes = list(self._spec_refreshes.values())
        for refresh in refreshes:
            refresh.cancel()
        await asyncio.gather(*refreshes, return_exceptions=True)
        if self._lane is not None:
            await self._lane.close()
        await self._r.aclose()

    async def flush(self) -> None:
        """Drop every key of this store's database (tests, benchmarks)."""
        await self._r.flushdb()

    # ---- keys --------------------------------------------------------------------------------

    @staticmethod
    @functools.lru_cache(maxsize=4096)  # a fleet serves a handful of models; each Lookup asks again
    def _base(model: str) -> str:
        # The hash tag keeps every key of a model in one slot: a worker's fence and lease are read
        # by the same call that changes or looks up its blocks, in any of the model's LoRAs.
        return f"{_PREFIX}:{{{hashlib.sha1(model.encode()).hexdigest()[:16]}}}:"

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def _namespace(namespace: Namespace) -> tuple[str, str]:
        base = RedisStore._base(namespace.model)
        return base, f"{base}{namespace.lora_name.encode().hex()}:"

    async def _fcall_direct(self, function: str, keys: Sequence[str], *args: Any) -> Any:
        """``_fcall`` through the lane, for a function that writes (see _DirectLane)."""
        lane = self._lane
        if lane is None:
            return await self._fcall(function, keys, *args)
        connection = await lane.take()
        if connection is None:
            return await self._fcall(function, keys, *args)
        reply = await exchange(connection, function, keys, args, lane.timeout_s, lane.give_back, lane.drop)
        if reply is not CLIENT_WAY:
            return reply
        return await self._fcall(function, keys, *args)  # reloads the library, retries, follows Sentinel

    async def _fcall(self, function: str, keys: Sequence[str], *args: Any) -> Any:
        try:
            return await self._r.fcall(function, len(keys), *keys, *args)
        except ResponseError as exc:
            if "function not found" not in str(exc).lower():
                raise
            # The server restarted empty or failed over to a replica without the library: load it.
            log.warning("redis lost the directory functions; loading them again")
            await self._r.function_load(LIBRARY, replace=True)
            return await self._r.fcall(function, len(keys), *keys, *args)

    async def _worker_base(self, worker_id: str) -> str | None:
        model = self._model_of.get(worker_id)
        if model is None:
            spec = await self.worker_spec(worker_id)
            return self._base(spec.model) if spec is not None else None
        return self._base(model)

    async def _spec_of(self, base: str, worker_id: str, epoch: str) -> WorkerSpec:
        spec = self._specs.get((worker_id, epoch))
        if spec is None:
            raw = await self._r.hget(f"{base}w:{worker_id}", "spec")
            if raw is None:
                raise DirectoryError("NOT_FOUND", f"worker {worker_id!r} is not registered")
            spec = self._specs[(worker_id, epoch)] = _spec_from_json(raw)
        return spec

    # ---- worker registry ---------------------------------------------------------------------

    @_reachable
    async def register(self, spec: WorkerSpec, last_sequence: int, now: float) -> tuple[int, bool]:
        self._model_specs.pop(spec.model, None)  # this replica's cache follows its own writes at once
        base = self._base(spec.model)
        layout = f"{spec.block_size}|{spec.hash_algorithm}|{spec.hash_length}"
        await self._r.hset(_MODELS, spec.model, base)
        reply = await self._register_call(
            base,
            spec,
            [
                base,
                spec.worker_id,
                str(spec.epoch),
                last_sequence,
                repr(now),
                repr(self.config.lease_s),
                self._lease_ms,
                _spec_json(spec),
                layout,
            ],
        )
        status = _text(reply[0])
        if status == "incompatible":
            other, theirs = _text(reply[1]), _text(reply[2]).split("|")
            mine = (spec.block_size, spec.hash_algorithm, spec.hash_length)
            raise DirectoryError(
                "FAILED_PRECONDITION",
                f"model {spec.model!r} is served with block_size={theirs[0]}, hash_algorithm="
                f"{theirs[1]!r}, hash_length={theirs[2]} (worker {other!r}); worker "
                f"{spec.worker_id!r} registered block_size={mine[0]}, hash_algorithm={mine[1]!r}, "
                f"hash_length={mine[2]}: their block hashes would never match",
            )
        if status == "busy":
            raise DirectoryError(
                "ALREADY_EXISTS",
                f"worker {spec.worker_id!r} is connected (epoch {_text(reply[1])}, last seen "
                f"{float(reply[2]):.1f}s ago); another agent may take over only after its lease "
                f"({self.config.lease_s:.0f}s) lapses",
            )
        self._specs[(spec.worker_id, str(spec.epoch))] = spec
        self._model_of[spec.worker_id] = spec.model
        return int(reply[1]), bool(reply[2])

    async def _register_call(self, base: str, spec: WorkerSpec, args: list[Any]) -> list[Any]:
        return await self._fcall("kvl_register", [f"{base}w:{spec.worker_id}"], *args)

    @_reachable
    async def disconnect(self, worker_id: str, epoch: int, now: float) -> None:
        base = await self._worker_base(worker_id)
        if base is not None:
            await self._fcall(
                "kvl_disconnect", [f"{base}w:{worker_id}"], base, worker_id, str(epoch), repr(now)
            )

    @_reachable
    async def heartbeat(self, worker_id: str, now: float) -> None:
        base = await self._worker_base(worker_id)
        if base is not None:
            await self._fcall(
                "kvl_heartbeat", [f"{base}w:{worker_id}"], base, worker_id, repr(now), self._lease_ms
            )

    @_reachable
    async def last_sequence(self, worker_id: str) -> int:
        base = await self._worker_base(worker_id)
        raw = await self._r.hget(f"{base}w:{worker_id}", "seq") if base else None
        return int(raw or 0)

    @_reachable
    async def worker_spec(self, worker_id: str) -> WorkerSpec | None:
        model = self._model_of.get(worker_id)
        bases = [self._base(model)] if model is not None else list((await self._bases()).values())
        for base in bases:
            raw = await self._r.hget(f"{base}w:{worker_id}", "spec")
            if raw is not None:
                spec = _spec_from_json(raw)
                self._model_of[worker_id] = spec.model
                return spec
        return None

    @_reachable
    async def model_spec(self, model: str) -> WorkerSpec | None:
        # Asked on every Lookup; a model's block layout holds while any of its workers is registered
        # (register refuses another), so a recent answer is as good as a fresh one. An older one is
        # refreshed beside the Lookup, not before it: a model whose Lookups came a second or more
        # apart paid two round trips through redis-py's client on every one.
        cached = self._model_specs.get(model)
        if cached is not None:
            age = time.monotonic() - cached[0]
            if age < MODEL_SPEC_FRESH_S:
                return cached[1]
            if age < MODEL_SPEC_STALE_S:
                if model not in self._spec_refreshes:
                    self._spec_refreshes[model] = asyncio.create_task(self._refresh_model_spec(model))
                return cached[1]
        return await self._fetch_model_spec(model)

    async def _refresh_model_spec(self, model: str) -> None:
        try:
            await self._fetch_model_spec(model)
        except (RedisError, OSError) as exc:  # the cached spec stays; the next Lookup tries again
            log.debug("model spec refresh failed", model=model, error=str(exc))
        finally:
            self._spec_refreshes.pop(model, None)

    async def _fetch_model_spec(self, model: str) -> WorkerSpec | None:
        now = time.monotonic()
        base = self._base(model)
        worker: Any = await self._r.srandmember(f"{base}workers")
        raw = await self._r.hget(f"{base}w:{_text(worker)}", "spec") if worker is not None else None
        if raw is None:
            self._model_specs.pop(model, None)
            return None
        spec = _spec_from_json(raw)
        self._model_specs[model] = (now, spec)
        return spec

    async def _set_state(self, worker_id: str, state: LeaseState) -> bool:
        base = await self._worker_base(worker_id)
        if base is None:
            return False
        return bool(await self._fcall("kvl_set_state", [f"{base}w:{worker_id}"], int(state)))

    @_reachable
    async def mark_resyncing(self, worker_id: str) -> None:
        await self._set_state(worker_id, LeaseState.RESYNCING)

    @_reachable
    async def set_draining(self, worker_id: str) -> bool:
        return await self._set_state(worker_id, LeaseState.DRAINING)

    async def _bases(self) -> dict[str, str]:
        return {_text(m): _text(b) for m, b in (await self._r.hgetall(_MODELS)).items()}

    @_reachable
    async def workers(self, now: float, model: str = "") -> list[WorkerView]:
        bases = await self._bases()
        views = []
        for name, base in sorted(bases.items()):
            if model and name != model:
                continue
            ids = sorted(_text(w) for w in await self._r.smembers(f"{base}workers"))
            async with self._r.pipeline(transaction=False) as pipe:
                for w in ids:
                    pipe.hgetall(f"{base}w:{w}")
                    pipe.exists(f"{base}alive:{w}")
                    pipe.hlen(f"{base}wr:{w}")
                replies = await pipe.execute()
            for i in range(len(ids)):
                fields = {_text(k): v for k, v in replies[3 * i].items()}
                if not fields:
                    continue
                connected = bool(replies[3 * i + 1])
                seen = float(fields["seen"])
                state = LeaseState(int(fields["state"]))
                if state == LeaseState.ACTIVE and not (connected and now - seen <= self.config.lease_s):
                    state = LeaseState.EXPIRED
                views.append(
                    WorkerView(
                        spec=_spec_from_json(fields["spec"]),
                        state=state,
                        connected=connected,
                        last_applied_sequence=int(fields["seq"]),
                        stored_blocks=int(fields["sblocks"]),
                        retained_blocks=int(fields["rblocks"]),
                        retained_runs=int(replies[3 * i + 2]),
                        last_seen_s_ago=max(0.0, now - seen),
                        events_ingested=int(fields["events"]),
                        resyncs=int(fields["resyncs"]),
                    )
                )
        return views

    @_reachable
    async def models(self) -> list[str]:
        bases = await self._bases()
        return sorted([m for m, base in bases.items() if await self._r.scard(f"{base}workers")])

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
        bases = await self._bases()
        previous = await self._fcall("kvl_epoch", [_EPOCH], epoch, *bases.values())
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

    @_reachable
    async def reap(self, now: float) -> list[Change]:
        changes: list[Change] = [*self._pending_changes, *await self._check_epoch()]
        self._pending_changes.clear()
        for model, base in sorted((await self._bases()).items()):
            reply = await self._fcall(
                "kvl_reap",
                [f"{base}exp"],
                base,
                repr(now),
                repr(self.config.lease_s),
                repr(self.config.drop_after_s),
            )
            reaped = _changes(model, reply)
            if any(change.kind == "dropped" for change in reaped):
                self._model_specs.pop(model, None)
            changes.extend(reaped)
        return changes

    # ---- block index -------------------------------------------------------------------------

    @_reachable
    async def apply(
        self, worker_id: str, epoch: int, sequence: int, events: Sequence[Event], now: float
    ) -> Applied:
        spec = self._specs.get((worker_id, str(epoch))) or await self.worker_spec(worker_id)
        if spec is None:
            return Applied(Fence.UNKNOWN_WORKER, 0)
        base = self._base(spec.model)
        args: list[Any] = [
            base,
            worker_id,
            str(epoch),
            sequence,
            repr(now),
            self._lease_ms,
            self.config.max_entries,
        ]
        model = spec.model
        for event in events:
            kind = type(event)
            if kind is Retained:
                assert isinstance(event, Retained)
                args += [
                    "R",
                    self._namespace(Namespace(model, event.lora_name))[1],
                    KEY_BYTES,
                    _keys(event.hashes),
                    pack_u32(event.block_ids),
                    event.num_groups,
                    event.handle,
                    event.expires_in_ms,
                    int(event.single_use),
                    int(event.tier or BlockTier.DEVICE),  # redis-py sends an IntEnum by its repr
                    pack_u32(event.tail_token_ids),
                    pack_u32(event.tail_block_ids),
                    event.registration_generation,
                ]
            elif kind is Stored or kind is Removed:
                assert isinstance(event, (Stored, Removed))
                args += [
                    "S" if kind is Stored else "D",
                    self._namespace(Namespace(model, event.lora_name))[1],
                    KEY_BYTES,
                    _keys(event.hashes),
                ]
            elif kind is Released:
                assert isinstance(event, Released)
                args += ["L", event.handle]
            elif kind is Cleared:
                args.append("C")
        status, last, touched = await self._fcall("kvl_apply", [f"{base}w:{worker_id}"], *args)
        return Applied(Fence(_text(status)), int(last), int(touched))

    async def _snapshot(self, worker_id: str, step: str, now: float, sequence: int = 0) -> None:
        base = await self._worker_base(worker_id)
        if base is None:
            raise KeyError(worker_id)
        await self._fcall(
            "kvl_snapshot", [f"{base}w:{worker_id}"], base, worker_id, step, repr(now), sequence
        )

    @_reachable
    async def begin_snapshot(self, worker_id: str, now: float) -> None:
        await self._snapshot(worker_id, "begin", now)

    @_reachable
    async def end_snapshot(self, worker_id: str, sequence: int, now: float) -> None:
        await self._snapshot(worker_id, "end", now, sequence)

    @_reachable
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
        base, prefix = self._namespace(namespace)
        floor = now + max(self.config.expiry_margin_s, margin_s)
        packed = _keys(hashes)
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
            if _text(reply[0]) == "none":
                reason = _text(reply[1])
                return PrefixMatch(None, [], reason or None)
            matched = int(reply[1])
            holdings = []
            for entry in reply[2:]:
                worker, epoch = _text(entry[0]), _text(entry[1])
                spec = self._specs.get((worker, epoch)) or await self._spec_of(base, worker, epoch)
                holdings.append(_holding(spec, matched, entry))
            best = holdings[0]
            if accept is None or accept(best.worker):
                others = [h for h in holdings[1:] if accept is None or accept(h.worker)]
                return PrefixMatch(best, others)
            if claim and best.single_use:
                await self.release_claim(namespace, best.worker.worker_id, best.handle, requester)
            excluded.append(best.worker.worker_id)

    @_reachable
    async def stored_prefixes(
        self, namespace: Namespace, hashes: Sequence[bytes], workers: Sequence[str], now: float
    ) -> dict[str, int]:
        if not workers or not hashes:
            return dict.fromkeys(workers, 0)
        base, prefix = self._namespace(namespace)
        reply = await self._fcall(
            "kvl_stored_prefixes",
            [f"{prefix}sto"],
            base,
            _keys(hashes),
            KEY_BYTES,
            repr(now),
            repr(self.config.lease_s),
            *workers,
        )
        return {w: int(n) for w, n in zip(workers, reply, strict=True)}

    @_reachable
    async def release_claim(self, namespace: Namespace, holder: str, handle: str, requester: str) -> bool:
        base, prefix = self._namespace(namespace)
        return bool(
            await self._fcall("kvl_release", [f"{base}wr:{holder}"], base, prefix, holder, handle, requester)
        )

    @_reachable
    async def find(self, namespace: Namespace, block_hash: bytes, now: float) -> list[Location]:
        base, prefix = self._namespace(namespace)
        reply = await self._fcall(
            "kvl_find",
            [f"{prefix}ret"],
            base,
            prefix,
            _keys([block_hash]),
            repr(now),
            repr(now + self.config.expiry_margin_s),
            repr(self.config.lease_s),
        )
        return _locations(reply)

    @_reachable
    async def counts(self) -> StoreCounts:
        return _store_counts(
            [await self._r.hgetall(f"{base}stats") for base in (await self._bases()).values()]
        )


class RedisChangeRelay:
    """Directory changes between kvloopd replicas, over Redis pub/sub (Watch on any replica)."""

    def __init__(self, client: aioredis.Redis, channel: str = f"{_PREFIX}:changes") -> None:
        self._r = client
        self.channel = channel

    async def send(self, payload: bytes) -> None:
        await self._r.publish(self.channel, payload)

    async def messages(self) -> AsyncIterator[bytes]:
        async with self._r.pubsub(ignore_subscribe_messages=True) as pubsub:
            await pubsub.subscribe(self.channel)
            async for message in pubsub.listen():
                if message["type"] == "message":
                    yield message["data"]
