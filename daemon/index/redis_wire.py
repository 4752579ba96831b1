"""What both Redis stores (one server, :mod:`.redis_store`; a cluster, :mod:`.redis_cluster_store`)
send to Redis and how they read its answers: the key layout, the block keys and event arguments the
functions of ``directory.lua`` take, the two ways of calling them (through redis-py's client, or sent
and read on a connection of the store's own), the decoding of their replies, and the relay of
changes between kvloopd replicas."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

import hiredis
import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisClusterException, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvloop.common.block_keys import KEY_BYTES, block_keys, packed_keys
from kvloop.common.packed_ids import pack_u32, unpack_u32
from kvloop.daemon.index.model import (
    BlockTier,
    Change,
    Holding,
    Location,
    PackedHashes,
    Removed,
    Retained,
    Stored,
    WorkerSpec,
)
from kvloop.daemon.index.store import StoreCounts, StoreUnavailable

log = structlog.get_logger("kvloop.daemon")

LIBRARY = resources.files("kvloop.daemon.index").joinpath("directory.lua").read_text()
PREFIX = "kvl"
MODELS = f"{PREFIX}:models"  # hash: model -> its key base (the only key outside a model's slot)
EPOCH = f"{PREFIX}:epoch"  # the failover epoch the data was last reconciled under
# Connections to Redis per kvloopd process (per node, on a cluster).
POOL_CONNECTIONS = 100


# ---- keys and arguments ----------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)  # a fleet serves a handful of models; each Lookup asks again
def model_base(model: str) -> str:
    """The prefix of a model's keys. Its hash tag keeps them in one slot: a worker's fence and lease
    are read by the same call that changes or looks up its blocks, in any of the model's LoRAs."""
    return f"{PREFIX}:{{{hashlib.sha1(model.encode()).hexdigest()[:16]}}}:"


def key_bytes(hashes: Sequence[bytes]) -> bytes:
    """The blocks' keys, concatenated (KEY_BYTES each: see kvloop.common.block_keys)."""
    if not hashes:
        return b""
    if isinstance(hashes, PackedHashes):
        return packed_keys(hashes.data, hashes.width)  # a Lookup's packed prompt: no walk per block
    return b"".join(block_keys(hashes))


def block_event_args(prefix: str, event: Retained | Stored | Removed) -> list[Any]:
    """An event that names blocks, as the apply functions take it under the namespace ``prefix``
    (see directory.lua)."""
    if isinstance(event, Retained):
        return [
            "R",
            prefix,
            KEY_BYTES,
            key_bytes(event.hashes),
            pack_u32(event.block_ids),
            event.num_groups,
            event.handle,
            event.expires_in_ms,
            int(event.single_use),
            int(event.tier or BlockTier.DEVICE),  # redis-py sends an IntEnum by its repr
            pack_u32(event.tail_token_ids),
            pack_u32(event.tail_block_ids),
            event.registration_generation,
            event.digests,
        ]
    return ["S" if isinstance(event, Stored) else "D", prefix, KEY_BYTES, key_bytes(event.hashes)]


def spec_json(spec: WorkerSpec) -> str:
    return json.dumps(asdict(spec), separators=(",", ":"))


# ---- replies ---------------------------------------------------------------------------------


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def spec_from_json(raw: bytes | str) -> WorkerSpec:
    fields = json.loads(raw)
    fields["parallel"] = tuple(fields["parallel"])
    return WorkerSpec(**fields)


@dataclass(frozen=True)
class RefusedHolder:
    """A lookup function's first holder that is not to be handed out: the caller excludes it and asks
    again, after giving back its claim if the function claimed it (a single-use run)."""

    worker_id: str
    handle: str
    claimed: bool


def refused_holder(entry: list) -> RefusedHolder:
    """A lookup function's holder entry (see ``holding``) as a refused holder."""
    return RefusedHolder(worker_id=text(entry[0]), handle=text(entry[2]), claimed=text(entry[6]) == "1")


def holding(spec: WorkerSpec, matched: int, entry: list) -> Holding:
    """One holder of a lookup function's answer: (worker, epoch, handle, expires_ms, ids, groups,
    single_use, tail_tokens, tail_blocks, tier, generation, digests)."""
    handle, expires_ms, ids, groups, single_use, tail_tokens, tail_blocks = entry[2:9]
    # the run's tier (absent from a library an older replica loaded: its runs are device runs)
    tier = entry[9] if len(entry) > 9 else BlockTier.DEVICE
    generation = entry[10] if len(entry) > 10 else 0
    digests = entry[11] if len(entry) > 11 else b""
    return Holding(
        worker=spec,
        matched_blocks=matched,
        handle=text(handle),
        expires_in_ms=int(expires_ms),
        packed_block_ids=bytes(ids),  # as Lua packed them: sent on as they are
        num_groups=int(groups),
        single_use=text(single_use) == "1",
        tail_token_ids=unpack_u32(tail_tokens),
        tail_block_ids=unpack_u32(tail_blocks),
        tier=int(tier),
        registration_generation=int(generation),
        digests=bytes(digests),
    )


def locations(reply: list) -> list[Location]:
    """A find function's answer."""
    found = []
    for entry in reply:
        if text(entry[0]) == "stored":
            found.append(Location(text(entry[1]), "stored", -1, [], "", 0, False, 0))
            continue
        _, worker, position, ids, handle, expires_ms, servable, tier = entry
        found.append(
            Location(
                worker_id=text(worker),
                kind="retained",
                position=int(position),
                block_ids=list(unpack_u32(ids)),
                handle=text(handle),
                expires_in_ms=int(expires_ms),
                servable=bool(servable),
                tier=int(tier),
            )
        )
    return found


def reap_changes(model: str, reply: Sequence[Sequence[Any]]) -> list[Change]:
    """A reaping function's answer (kind, worker, blocks, detail, and maybe more) as changes."""
    return [Change(text(k), text(w), model, int(b), text(d)) for k, w, b, d, *_ in reply]


def store_counts(stats: Sequence[dict]) -> StoreCounts:
    """The directory's counts, summed over the ``stats`` hashes it keeps (one per model, or per bucket
    on a cluster)."""
    totals = {"entries": 0, "runs": 0, "events": 0, "evictions": 0, "expired": 0}
    for fields in stats:
        for field, value in fields.items():
            if text(field) in totals:
                totals[text(field)] += int(value)
    return StoreCounts(
        entries=totals["entries"],
        retained_runs=totals["runs"],
        events_ingested=totals["events"],
        evictions=totals["evictions"],
        expired_runs=totals["expired"],
    )


# ---- calls -----------------------------------------------------------------------------------


def redacted(url: str) -> str:
    """The URL without its password, for logs."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def reachable(method: Callable) -> Callable:
    """Redis unreachable -> StoreUnavailable (the service answers UNAVAILABLE, never UNKNOWN)."""

    @functools.wraps(method)
    async def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return await method(*args, **kwargs)
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


async def fcall(client: Any, function: str, keys: Sequence[str], *args: Any) -> Any:
    """FCALL through redis-py's client (its retries, reconnection and redirections)."""
    try:
        return await client.fcall(function, len(keys), *keys, *args)
    except ResponseError as exc:
        if "function not found" not in str(exc).lower():
            raise
        # The server restarted empty or failed over to a replica without the library: load it.
        log.warning("redis lost the directory functions; loading them again")
        await client.function_load(LIBRARY, replace=True)
        return await client.fcall(function, len(keys), *keys, *args)


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


class RedisChangeRelay:
    """Directory changes between kvloopd replicas, over Redis pub/sub (Watch on any replica)."""

    def __init__(self, client: aioredis.Redis, channel: str = f"{PREFIX}:changes") -> None:
        self._r = client
        self.channel = channel

    @classmethod
    def of_plans(cls, client: aioredis.Redis) -> RedisChangeRelay:
        """Route's plans between replicas (daemon/plans.py), on a channel of their own."""
        return cls(client, f"{PREFIX}:plans")

    async def send(self, payload: bytes) -> None:
        await self._r.publish(self.channel, payload)

    async def messages(self) -> AsyncIterator[bytes]:
        async with self._r.pubsub(ignore_subscribe_messages=True) as pubsub:
            await pubsub.subscribe(self.channel)
            async for message in pubsub.listen():
                if message["type"] == "message":
                    yield message["data"]
