"""The block directory sharded over a Redis Cluster (>= 7.0, or Valkey in cluster mode).

On one Redis server (:mod:`.redis_store`) a model's whole index shares one hash tag, so one model's
traffic lands on one node however large the cluster is. Here a model's block keys are spread over
``buckets`` hash tags, in columns (:mod:`.cluster_layout`): a chain's first block (with its LoRA;
the agent names it in each event) picks a column, a retained run's handle and a prefix-cache block's
own key pick a bucket in it, so conversations that share a system prompt still spread over the
column's buckets. A Lookup or a Route asks the column's buckets side by side and merges their
answers.

The registry (worker hashes, fences, liveness) stays in the model's own slot, as on one server. A
bucket call never reads it: the caller passes the workers its *view* of the registry holds not live
(one ``kvl_view`` call, kept ``VIEW_FRESH_S``, refreshed beside the Lookup up to ``VIEW_STALE_S``, and
kept current by this replica's own writes). A run carries the epoch it was retained under, and a
holding whose epoch is not its worker's current one is never handed out. So:

* a worker that another replica saw die (or re-register) may be handed out by this one for up to
  ``VIEW_STALE_S``; the puller's READ then fails and it recomputes, the same path as a peer that dies
  after a Lookup. Memory is never read after it is freed: a holder frees a run's blocks only after
  kvloopd confirmed the drop and a read window passed, whatever any replica's view says;
* a batch is fenced in the model's slot first (``kvl_fence``), then applied bucket by bucket. A
  failure in between ends the agent's stream with UNAVAILABLE; the agent's next registration then
  finds the store ahead of it and re-pushes its state (a resync), as after any lost batch;
* a failover of any shard's primary (the cluster's current epoch grew) marks every worker
  resyncing, as a Sentinel failover does on one server: a promoted replica may lack acknowledged
  writes. It is noticed by the periodic reap (``reap_interval_s``), well within the read window.

Where it differs from one server: ``max_entries`` bounds each bucket (a model holds up to
``buckets`` times as many); ``find`` asks every bucket (an operator's command, not a request path);
a Lookup that claims a single-use run may claim one in each bucket of the column for a moment (the
ones not handed out are given back at once).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterDownError, ReadOnlyError, TryAgainError

from kvloop.common.block_keys import KEY_BYTES
from kvloop.daemon.index import redis_wire as wire
from kvloop.daemon.index.cluster_layout import (
    DEFAULT_SPREAD,
    LAYOUT_KEY,
    Layout,
    claim_layout,
    merged_lookup,
)
from kvloop.daemon.index.model import (
    Change,
    Cleared,
    Event,
    LeaseState,
    Location,
    Namespace,
    PrefixMatch,
    Released,
    Removed,
    Retained,
    Stored,
    WorkerSpec,
    WorkerView,
)
from kvloop.daemon.index.redis_registry import SlotRegistry
from kvloop.daemon.index.store import Applied, Fence, IndexConfig, StoreCounts

log = structlog.get_logger("kvloop.daemon")

# Refusals a node answers before a function runs (nothing was written): a redirection, a cluster
# without the slot's owner, a replica's READONLY. The call then goes the cluster client's way.
_REFUSED_BEFORE_RUNNING = (AskError, TryAgainError, ClusterDownError, ReadOnlyError)

# Buckets per model: enough that a model spreads over every primary of a large cluster (a node owns
# about buckets / primaries of them), few enough that reaping all of them each interval stays cheap.
DEFAULT_BUCKETS = 64
# How long a view of a model's workers answers Lookups as it is, and how long while a refresh runs.
# The longest a call sent on a node's connection directly waits for its reply.
CALL_TIMEOUT_S = 5.0
VIEW_FRESH_S = 0.25
VIEW_STALE_S = 1.0
# A bucket's expired runs are reaped at most this often (in the store's clock), the buckets in eight
# phases: a Lookup never hands out a run past its lease anyway, so reaping is only about memory, and
# a call per bucket every reap interval (64 buckets, every 0.5 s) was most of an idle replica's work.
BUCKET_REAP_S = 4.0


@dataclass(slots=True)
class _Worker:
    epoch: str
    state: int
    seen: float
    alive: bool
    unverified: bool = False  # a READ from it failed its digest check since it registered

    def live(self, now: float, lease_s: float) -> bool:
        fresh = now - self.seen <= lease_s
        return self.state == LeaseState.ACTIVE and self.alive and fresh and not self.unverified


def _holder(reply: list[Any]) -> tuple[str, str]:
    """The worker and handle of a lookup reply's first holder."""
    return wire.text(reply[2][0]), wire.text(reply[2][2])


def _marked(fields: list[Any]) -> bool:
    return bool(fields) and int(fields[0]) == 1


@dataclass(slots=True)
class _View:
    fetched: float  # monotonic
    resyncing: bool
    workers: dict[str, _Worker]

    def not_live(self, now: float, lease_s: float) -> str:
        return "\n".join(w for w, worker in self.workers.items() if not worker.live(now, lease_s))

    def current(self, worker_id: str, epoch: str) -> bool:
        """A run retained under ``epoch`` is its worker's (not one of an epoch it has left)."""
        worker = self.workers.get(worker_id)
        return worker is not None and worker.epoch == epoch


@dataclass(frozen=True, slots=True)
class _Blocks:
    """Prefix-cache blocks of one event that go to one bucket: 'S' stored, 'D' removed."""

    kind: str
    lora_name: str
    keys: bytes


class RedisClusterStore:
    """The DirectoryStore on a Redis Cluster, sharded by columns of buckets (see cluster_layout)."""

    name = "redis-cluster"
    in_process = False
    epoch: int
    clock = staticmethod(time.time)  # wall time: replicas on different hosts agree on it (NTP)

    def __init__(
        self,
        client: RedisCluster,
        config: IndexConfig | None = None,
        buckets: int = DEFAULT_BUCKETS,
        spread: int = DEFAULT_SPREAD,
    ):
        self._layout = Layout(buckets, min(spread, buckets))
        self.config = config or IndexConfig()
        self._r = client
        registry = self._registry = SlotRegistry(client, self.config, self._fcall)
        # What the worker registry answers alone: all it reads and writes is in the model's slot.
        self.last_sequence = wire.reachable(registry.last_sequence)
        self.worker_spec = wire.reachable(registry.worker_spec)
        self.model_spec = wire.reachable(registry.model_spec)
        self.models = wire.reachable(registry.models)
        self.epoch = 0  # the cluster's current epoch + 1, once checked
        # max_entries bounds each: a model holds up to buckets x max_entries
        self.buckets = self._layout.buckets
        self.spread = self._layout.spread  # the buckets one chain's runs and blocks spread over
        self._views: dict[str, _View] = {}
        self._view_refreshes: dict[str, asyncio.Task] = {}
        # Calls in flight at once: redis-py's cluster client refuses a call outright when the node's
        # pool is exhausted (it has no blocking pool), so a burst (a find asks every bucket) waits here.
        self._in_flight = asyncio.Semaphore(wire.POOL_CONNECTIONS)
        self._epoch_turn = 0  # the node asked for the cluster's epoch next
        self._reap_due: dict[str, list[float]] = {}  # model -> when each bucket is next reaped

    @classmethod
    async def connect_cluster(
        cls,
        url: str,
        config: IndexConfig | None = None,
        buckets: int = DEFAULT_BUCKETS,
        spread: int = DEFAULT_SPREAD,
        **options: Any,
    ) -> RedisClusterStore:
        """Connect through any node of the cluster (``redis://`` or ``rediss://``), check the key
        layout it holds and load the function library on every primary."""
        # room beyond the calls kvloopd bounds itself (see _in_flight) for pub/sub and topology reads
        client = RedisCluster.from_url(url, max_connections=wire.POOL_CONNECTIONS + 16, **options)
        try:
            await client.initialize()
            await claim_layout(client, Layout(buckets, min(spread, buckets)))
            await client.function_load(wire.LIBRARY, replace=True)  # sent to every primary
        except Exception:
            await client.aclose()
            raise
        log.info("directory store on a redis cluster", url=wire.redacted(url), buckets=buckets, spread=spread)
        store = cls(client, config, buckets, spread)
        await store._check_epoch()  # record the epoch before this replica writes anything
        return store

    async def close(self) -> None:
        refreshes = list(self._view_refreshes.values())
        for refresh in refreshes:
            refresh.cancel()
        await asyncio.gather(*refreshes, return_exceptions=True)
        await self._registry.close()
        await self._r.aclose()

    def change_relay(self) -> wire.RedisChangeRelay:
        return wire.RedisChangeRelay(self._r)

    def plan_relay(self) -> wire.RedisChangeRelay:
        return wire.RedisChangeRelay.of_plans(self._r)

    # ---- keys --------------------------------------------------------------------------------

    _base = staticmethod(wire.model_base)

    def _bucket_base(self, model: str, bucket: int | str | bytes) -> str:
        return self._layout.base(model, bucket)

    async def _bounded(self, call: Awaitable[Any]) -> Any:
        async with self._in_flight:
            return await call

    async def _fcall(self, function: str, keys: Sequence[str], *args: Any) -> Any:
        async with self._in_flight:
            return await wire.fcall(self._r, function, keys, *args)

    async def _fcall_direct(self, function: str, keys: Sequence[str], *args: Any) -> Any:
        """``_fcall`` on a connection of the node that owns the key's slot, sent and read directly:
        redis-py's cluster client does several times a plain call's Python work per command (the
        request path's calls: fences, bucket applies, Lookups). A redirection (the slot moved), a
        replica's refusal (READONLY), a node that is down or lost the library: the call goes the
        client's way, which follows the cluster and retries."""
        async with self._in_flight:
            reply = await self._send_direct(function, keys, args)
        if reply is wire.CLIENT_WAY:
            return await self._fcall(function, keys, *args)
        return reply

    async def _send_direct(self, function: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            node = self._r.nodes_manager.get_node_from_slot(key_slot(keys[0].encode()))
            connection = node.acquire_connection()
        except Exception:  # no node known for the slot, or its pool is full
            return wire.CLIENT_WAY

        async def discard(connection: Any) -> None:
            await connection.disconnect()
            node.release(connection)

        return await wire.exchange(
            connection, function, keys, args, CALL_TIMEOUT_S, node.release, discard, _REFUSED_BEFORE_RUNNING
        )

    def _bucket_namespace(self, namespace: Namespace, bucket: int | str) -> tuple[str, str]:
        bb = self._bucket_base(namespace.model, bucket)
        return bb, f"{bb}{namespace.lora_name.encode().hex()}:"

    # ---- the view of a model's workers -------------------------------------------------------

    async def _view(self, model: str) -> _View:
        view = self._views.get(model)
        if view is not None:
            age = time.monotonic() - view.fetched
            if age < VIEW_FRESH_S:
                return view
            if age < VIEW_STALE_S:
                if model not in self._view_refreshes:
                    self._view_refreshes[model] = asyncio.create_task(self._refresh_view(model))
                return view
        return await self._fetch_view(model)

    async def _refresh_view(self, model: str) -> None:
        try:
            await self._fetch_view(model)
        except Exception as exc:  # the view ages out and the next Lookup fetches it itself
            log.debug("worker view refresh failed", model=model, error=str(exc))
        finally:
            self._view_refreshes.pop(model, None)

    async def _fetch_view(self, model: str) -> _View:
        fetched = time.monotonic()
        base = self._base(model)
        reply = await self._fcall("kvl_view", [f"{base}workers"], base)
        # the sixth field (its unverified mark) is absent from a library an older replica loaded
        workers = {
            wire.text(w): _Worker(wire.text(epoch), int(state), float(seen), bool(alive), _marked(marked))
            for w, epoch, state, seen, alive, *marked in reply[1:]
        }
        view = self._views[model] = _View(fetched, int(reply[0]) > 0, workers)
        return view

    def _forget_view(self, model: str | None) -> None:
        if model is None:
            self._views.clear()
        else:
            self._views.pop(model, None)

    def _heard(self, worker_id: str, now: float) -> None:
        """A message from the worker reached the registry through this replica: its view follows."""
        view = self._views.get(self._registry.model_of(worker_id) or "")
        worker = view.workers.get(worker_id) if view is not None else None
        if worker is not None:
            worker.seen, worker.alive = now, True
            if worker.state == LeaseState.EXPIRED:
                worker.state = LeaseState.ACTIVE

    # ---- worker registry ---------------------------------------------------------------------

    async def _purge(self, model: str, worker_id: str, buckets: Sequence[Any]) -> int:
        """Drop everything ``worker_id`` holds in ``buckets`` (one call per bucket, side by side)."""
        touched = await asyncio.gather(
            *(
                self._fcall("kvl_bucket_purge", [f"{bb}stats"], bb, worker_id)
                for bb in (self._bucket_base(model, wire.text(b)) for b in buckets)
            )
        )
        return sum(int(t) for t in touched)

    @wire.reachable
    async def register(self, spec: WorkerSpec, last_sequence: int, now: float) -> tuple[int, bool]:
        reply = await self._registry.register_call(spec, last_sequence, now, "1")
        if wire.text(reply[0]) == "ok":
            self._forget_view(spec.model)
            await self._purge(spec.model, spec.worker_id, reply[3])
        return self._registry.registered(spec, reply)

    @wire.reachable
    async def disconnect(self, worker_id: str, epoch: int, now: float) -> None:
        await self._registry.disconnect(worker_id, epoch, now)
        self._forget_view(self._registry.model_of(worker_id))

    @wire.reachable
    async def heartbeat(self, worker_id: str, now: float) -> None:
        await self._registry.heartbeat(worker_id, now)
        self._heard(worker_id, now)

    @wire.reachable
    async def mark_resyncing(self, worker_id: str) -> None:
        await self._registry.mark_resyncing(worker_id)
        self._forget_view(self._registry.model_of(worker_id))

    @wire.reachable
    async def set_draining(self, worker_id: str) -> bool:
        draining = await self._registry.set_draining(worker_id)
        self._forget_view(self._registry.model_of(worker_id))
        return draining

    @wire.reachable
    async def set_unverified(self, worker_id: str) -> bool:
        marked = await self._registry.set_unverified(worker_id)
        self._forget_view(self._registry.model_of(worker_id))
        return marked

    @wire.reachable
    async def workers(self, now: float, model: str = "") -> list[WorkerView]:
        views = await self._registry.workers(now, model)
        await asyncio.gather(*(self._count_blocks(view) for view in views))
        return views

    async def _count_blocks(self, view: WorkerView) -> None:
        """A worker's block counts, which live in the buckets it wrote to (read side by side)."""
        worker, model = view.spec.worker_id, view.spec.model
        members = await self._bounded(self._r.smembers(f"{self._base(model)}wb:{worker}"))
        bases = [self._bucket_base(model, wire.text(b)) for b in members]
        counters = await asyncio.gather(*(self._bounded(self._r.hgetall(f"{bb}wc:{worker}")) for bb in bases))
        runs = await asyncio.gather(*(self._bounded(self._r.hlen(f"{bb}wr:{worker}")) for bb in bases))
        totals = {"rblocks": 0, "sblocks": 0, "events": 0}
        for fields in counters:
            for field, value in fields.items():
                if wire.text(field) in totals:
                    totals[wire.text(field)] += int(value)
        view.retained_blocks, view.stored_blocks = totals["rblocks"], totals["sblocks"]
        view.events_ingested, view.retained_runs = totals["events"], sum(runs)

    async def directory_epoch(self) -> int | None:
        """The cluster's current epoch (it grows with each failover and each slot move), as the next
        node in turn that answers reports it: the cluster's gossip carries a new epoch to every node,
        and asking one node per reap keeps an idle replica's work small."""
        nodes = self._r.get_nodes()
        for i in range(len(nodes)):
            node = nodes[(self._epoch_turn + i) % len(nodes)]
            try:
                info = await self._bounded(self._r.cluster_info(target_nodes=node))
            except Exception:  # a node that is down: the next one answers
                continue
            self._epoch_turn += i + 1
            if isinstance(info, dict) and "cluster_current_epoch" in info:
                return int(info["cluster_current_epoch"])
        return None

    def _primary_moved(self) -> bool:
        return False  # the cluster client follows its slots itself; failovers are caught by the epoch

    async def _check_epoch(self) -> list[Change]:
        epoch = await self.directory_epoch()
        if epoch is None:
            return []
        previous = await self._fcall("kvl_epoch", [wire.EPOCH], epoch)
        known, self.epoch = self.epoch, max(self.epoch, epoch + 1)
        if previous is None or int(previous) < 0:
            if not (known and self.epoch > known):
                return []
            # Another replica won the compare-and-set and marked the workers; what this one wrote
            # meanwhile may have gone to a primary being demoted, so it asks its own agents again.
            self._forget_view(None)
            log.warning("redis cluster epoch moved: this replica's agents resync", epoch=epoch)
            return [Change("primary_moved", "", "", 0, f"the cluster's epoch moved (epoch {epoch})")]
        for base in (await self._registry.bases()).values():
            await self._fcall("kvl_resync_all", [f"{base}workers"], base)
        self._forget_view(None)
        log.warning(
            "redis cluster failover: every worker must resync", epoch=epoch, previous_epoch=int(previous)
        )
        return [Change("failover", "", "", 0, f"directory epoch {int(previous)} -> {epoch}: resync required")]

    def _buckets_to_reap(self, model: str, now: float) -> list[int]:
        due = self._reap_due.get(model)
        if due is None:  # first seen: all now, then spread over eight phases
            due = self._reap_due[model] = [now + BUCKET_REAP_S * (b % 8) / 8 for b in range(self.buckets)]
            return list(range(self.buckets))
        ready = [b for b in range(self.buckets) if due[b] <= now]
        for b in ready:
            due[b] = now + BUCKET_REAP_S
        return ready

    @wire.reachable
    async def reap(self, now: float) -> list[Change]:
        changes: list[Change] = await self._check_epoch()
        for model, base in sorted((await self._registry.bases()).items()):
            reply = await self._fcall(
                "kvl_reap_workers",
                [f"{base}workers"],
                base,
                repr(now),
                repr(self.config.lease_s),
                repr(self.config.drop_after_s),
            )
            for kind, worker, blocks, detail, *buckets in reply:
                dropped = wire.text(kind) == "dropped"
                purged = await self._purge(model, wire.text(worker), buckets[0]) if dropped else 0
                changes.append(
                    Change(wire.text(kind), wire.text(worker), model, int(blocks) + purged, wire.text(detail))
                )
                if dropped:
                    self._registry.forget_model(model)
            if reply:
                self._forget_view(model)
            expired = await asyncio.gather(
                *(
                    self._fcall("kvl_bucket_reap", [f"{bb}stats"], bb, repr(now))
                    for bb in (self._bucket_base(model, b) for b in self._buckets_to_reap(model, now))
                )
            )
            for reaped in expired:
                changes.extend(wire.reap_changes(model, reaped))
        return changes

    # ---- block index -------------------------------------------------------------------------

    @wire.reachable
    async def apply(
        self, worker_id: str, epoch: int, sequence: int, events: Sequence[Event], now: float
    ) -> Applied:
        spec = await self._registry.spec_at(worker_id, epoch)
        if spec is None:
            return Applied(Fence.UNKNOWN_WORKER, 0)
        model, base = spec.model, self._base(spec.model)
        placed = [self._place(event) for event in events]
        moves: list[Any] = []
        generation = 0
        for event, where in zip(events, placed, strict=True):
            if isinstance(event, Retained):
                moves += ["R", event.handle, where[0][0]]
                generation = max(generation, event.registration_generation)
            elif isinstance(event, Released):
                moves += ["L", event.handle]
        reply = await self._fcall_direct(
            "kvl_fence",
            [f"{base}w:{worker_id}"],
            base,
            worker_id,
            str(epoch),
            sequence,
            repr(now),
            self._registry.lease_ms,
            generation,
            *sorted({bucket for where in placed for bucket, _ in where}),
            "|",
            *moves,
        )
        status = wire.text(reply[0])
        if status != "applied":
            return Applied(Fence(status), int(reply[1]), int(reply[2]))
        last, worker_generation, rose = int(reply[1]), int(reply[2]), bool(reply[3])
        releases = iter([wire.text(b) for b in reply[4]])
        written = [wire.text(b) for b in reply[5]]
        per_bucket: dict[str, list[Any]] = {}
        if rose:  # a newer KV-cache registration: every older run of the worker is withdrawn
            for bucket in written:
                per_bucket.setdefault(bucket, []).extend(["G", worker_generation])
        for event, where in zip(events, placed, strict=True):
            if isinstance(event, Retained):
                if old := next(releases):  # the same handle retained before, in another bucket
                    per_bucket.setdefault(old, []).extend(["L", event.handle])
            elif isinstance(event, Released):
                where = [(b, event) for b in [next(releases)] if b]
            elif not where:  # a clear, or a removal of blocks of no known chain
                where = [(b, event) for b in written]
            for bucket, part in where:
                per_bucket.setdefault(bucket, []).extend(self._args(model, bucket, part))
        try:
            touched = await asyncio.gather(
                *(
                    self._fcall_direct(
                        "kvl_bucket_apply",
                        [f"{bb}stats"],
                        bb,
                        worker_id,
                        str(epoch),
                        repr(now),
                        self.config.max_entries,
                        worker_generation,
                        *args,
                    )
                    for bb, args in ((self._bucket_base(model, b), a) for b, a in per_bucket.items())
                )
            )
        except Exception:
            # Fenced but not (all) applied: nothing of the worker is served until its agent re-pushes
            # (its next registration finds the store ahead of it).
            await asyncio.gather(self.mark_resyncing(worker_id), return_exceptions=True)
            raise
        self._heard(worker_id, now)
        return Applied(Fence.APPLIED, last, sum(int(t) for t in touched))

    def _place(self, event: Event) -> list[tuple[str, Event | _Blocks]]:
        """The buckets an event goes to, with its part there; none for the events whose buckets the
        fence call answers (releases, clears, removals of blocks of no known chain)."""
        layout = self._layout
        if isinstance(event, Retained):
            root = wire.key_bytes(event.hashes[:1])
            return [(str(layout.of_run(event.lora_name, root, event.handle)), event)]
        if isinstance(event, Stored):
            keys = wire.key_bytes(event.hashes)
            column = layout.column(event.lora_name, event.root if event.root is not None else keys)
            return [
                (str(bucket), _Blocks("S", event.lora_name, part))
                for bucket, (part, _) in layout.split(column, keys).items()
            ]
        if isinstance(event, Removed) and event.roots is not None:
            keys = wire.key_bytes(event.hashes)
            chains: dict[int, bytearray] = {}
            for i, root in enumerate(event.roots):  # removals span chains: each block by its own root
                chains.setdefault(layout.column(event.lora_name, root), bytearray()).extend(
                    keys[i * KEY_BYTES : (i + 1) * KEY_BYTES]
                )
            return [
                (str(bucket), _Blocks("D", event.lora_name, part))
                for column, chain in chains.items()
                for bucket, (part, _) in layout.split(column, bytes(chain)).items()
            ]
        return []

    def _args(self, model: str, bucket: str, event: Event | _Blocks) -> list[Any]:
        """An event as kvl_bucket_apply takes it in ``bucket`` (see directory.lua)."""
        if isinstance(event, Released):
            return ["L", event.handle]
        if isinstance(event, Cleared):
            return ["C"]
        prefix = self._bucket_namespace(Namespace(model, event.lora_name), bucket)[1]
        if isinstance(event, _Blocks):
            return [event.kind, prefix, KEY_BYTES, event.keys]
        return wire.block_event_args(prefix, event)

    @wire.reachable
    async def begin_snapshot(self, worker_id: str, now: float) -> None:
        reply = await self._registry.snapshot(worker_id, "begin", now, 0, "1")
        model = self._registry.model_of(worker_id) or ""
        self._forget_view(model)
        if isinstance(reply, list):
            await self._purge(model, worker_id, reply)

    @wire.reachable
    async def end_snapshot(self, worker_id: str, sequence: int, now: float) -> None:
        await self._registry.snapshot(worker_id, "end", now, sequence)
        self._forget_view(self._registry.model_of(worker_id))

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
        base = self._base(namespace.model)
        packed = wire.key_bytes(hashes)
        # every run that can answer the prompt holds its first block: it is in one of these buckets
        spaces = [
            self._bucket_namespace(namespace, b)
            for b in self._layout.chain(namespace.lora_name, packed[:KEY_BYTES])
        ]
        floor = now + max(self.config.expiry_margin_s, margin_s)
        excluded: list[str] = []
        refreshed = False
        while True:
            view = await self._view(namespace.model)
            if view.resyncing:
                return PrefixMatch(None, [], "directory_resyncing")
            not_live = view.not_live(now, self.config.lease_s)
            replies = await asyncio.gather(
                *(
                    self._fcall_direct(
                        "kvl_bucket_lookup",
                        [f"{prefix}ret"],
                        bb,
                        prefix,
                        packed,
                        KEY_BYTES,
                        local_blocks,
                        requester,
                        repr(now),
                        repr(floor),
                        repr(self.config.lease_s),
                        int(claim),
                        "\n".join(excluded),
                        not_live,
                    )
                    for bb, prefix in spaces
                )
            )
            reply, winner, losers = merged_lookup(replies, claim)
            if losers:  # single-use runs claimed by the buckets whose answer is not handed out
                await asyncio.gather(
                    *(
                        self._release(spaces[i][0], spaces[i][1], *_holder(replies[i]), requester)
                        for i in losers
                    )
                )
            answer = await self._registry.answer(base, reply, accept, view.current)
            if isinstance(answer, PrefixMatch):
                return answer
            if claim and answer.claimed:  # the first entry was claimed: give it back
                bb, prefix = spaces[winner]
                await self._release(bb, prefix, answer.worker_id, answer.handle, requester)
            if not refreshed and any(wire.text(entry[0]) not in view.workers for entry in reply[2:]):
                refreshed = True  # a worker registered since the view was read: read it again
                self._forget_view(namespace.model)
                continue
            excluded.append(answer.worker_id)

    async def _release(self, bb: str, prefix: str, holder: str, handle: str, requester: str) -> bool:
        return bool(
            await self._fcall("kvl_release", [f"{bb}wr:{holder}"], bb, prefix, holder, handle, requester)
        )

    @wire.reachable
    async def release_claim(self, namespace: Namespace, holder: str, handle: str, requester: str) -> bool:
        base = self._base(namespace.model)
        bucket = await self._bounded(self._r.hget(f"{base}wh:{holder}", handle))
        if bucket is None:
            return False
        bb, prefix = self._bucket_namespace(namespace, wire.text(bucket))
        return await self._release(bb, prefix, holder, handle, requester)

    @wire.reachable
    async def stored_prefixes(
        self, namespace: Namespace, hashes: Sequence[bytes], workers: Sequence[str], now: float
    ) -> dict[str, int]:
        counts = dict.fromkeys(workers, 0)
        if not workers or not hashes:
            return counts
        view = await self._view(namespace.model)
        live = [
            w for w in workers if (v := view.workers.get(w)) is not None and v.live(now, self.config.lease_s)
        ]
        if not live:
            return counts
        packed = wire.key_bytes(hashes)
        n = len(packed) // KEY_BYTES
        layout = self._layout
        parts = layout.split(layout.column(namespace.lora_name, packed[:KEY_BYTES]), packed)
        # Each bucket counts the leading blocks it holds of its own share of the prompt, in order: a
        # worker's cached prefix ends at the first block that any bucket finds it lacks.
        replies = await asyncio.gather(
            *(
                self._fcall_direct(
                    "kvl_bucket_stored_prefixes",
                    [f"{prefix}sto"],
                    bb,
                    keys,
                    KEY_BYTES,
                    repr(now),
                    "0",
                    *live,
                )
                for (bb, prefix), keys in (
                    (self._bucket_namespace(namespace, b), keys) for b, (keys, _) in parts.items()
                )
            )
        )
        ends = dict.fromkeys(live, n)
        for (_, positions), reply in zip(parts.values(), replies, strict=True):
            for w, held in zip(live, reply, strict=True):
                if int(held) < len(positions):
                    ends[w] = min(ends[w], positions[int(held)])
        counts.update(ends)
        return counts

    @wire.reachable
    async def find(self, namespace: Namespace, block_hash: bytes, now: float) -> list[Location]:
        view = await self._view(namespace.model)
        dead = view.not_live(now, self.config.lease_s)
        replies = await asyncio.gather(
            *(
                self._fcall(
                    "kvl_bucket_find",
                    [f"{prefix}ret"],
                    bb,
                    prefix,
                    wire.key_bytes([block_hash]),
                    repr(now),
                    repr(now + self.config.expiry_margin_s),
                    "0",
                    dead,
                )
                for bb, prefix in (self._bucket_namespace(namespace, b) for b in range(self.buckets))
            )
        )
        return [location for reply in replies for location in wire.locations(reply)]

    @wire.reachable
    async def counts(self) -> StoreCounts:
        stats = []
        for model in await self._registry.bases():
            stats += await asyncio.gather(
                *(
                    self._bounded(self._r.hgetall(f"{self._bucket_base(model, b)}stats"))
                    for b in range(self.buckets)
                )
            )
        return wire.store_counts(stats)

    async def flush(self) -> None:
        await self._r.flushdb()  # sent to every primary
        await self._r.set(LAYOUT_KEY, self._layout.record())  # an empty store of this layout remains
        self._views.clear()
        self._registry.forget()
