"""The simulated fleet of `kvloop bench replay`: prefill and decode workers speaking kvloopd's real
protocol, driven through a trace in trace time.

- Decode workers announce each finished turn's blocks the way the connector and the sidecar do:
  the connector's own ``KvloopBlocksRetained`` / ``KvloopRetentionReleased`` events, converted by the
  sidecar's ``WorkerMirror`` and streamed by its ``DirectoryLink`` (sequence numbers, acks, heartbeats,
  snapshots) over one Connect stream per worker. A decode keeps a run for the lease and frees it at
  its end; when its retention memory (``retention_blocks``, blocks of equal hash shared as in vLLM's
  prefix-cached block pool) cannot take a new run it evicts the oldest runs first.
- With a host-memory tier (``host_retention_blocks`` per decode, 0: none) a run the device evicts
  moves to the decode's host pool instead of being dropped. The copy is announced as the connector
  announces one (a retained run of its own, handle ``<request id>@host``, tier host, pool slot ids
  for block ids, read from the pool's engine ``<worker>@host`` that the worker registers) and the
  device run is released in the same event batch, so no Lookup sees neither. The copy keeps the
  run's lease. The host pool is the connector's in what it holds and when a block leaves it: blocks
  of equal hash held once (common/held_blocks.py; ``host_pool_shared`` False holds each run's apart,
  as a pool that copies every run whole would), a run released once a later turn's copy that starts
  with its blocks arrives (superseded), and for room, below 10% free, runs released down to 25% free
  (host_eviction.room_wanted) in the order of the connector's own eviction policy (``host_eviction``:
  host/eviction.py's classes, told of every turn the decode retains; ``lru``, the default, evicts the
  oldest runs first). What it models apart is when a run enters: the connector copies every run when
  it is retained and gives copied runs up first from the KV cache, and leases copies for
  ``kvloop_host_retention_ttl_s``.
- Prefill workers keep a local prefix cache (vLLM's LRU over freed blocks, a prompt's tail evicted
  before its head), publish its stored/removed blocks through their own link as a prefill's sidecar
  would, and ask kvloopd with the connector's own ``DirectoryLookups`` (same request, same
  constraints, same deadline and back-off).
- Trace time maps to the daemon's clock: the puller's lease margin is applied in trace time (the
  decode withdraws a run from the directory ``expiry_margin_s`` before its lease ends), so the
  daemon gets leases long enough never to lapse on its own and no margin of its own.

Every event a lookup could depend on is acknowledged by the daemon before the lookup is sent, so a
replay is deterministic for a given trace and fleet (the measured event lag is that wait).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

from kvloop.agents.connector.directory import DirectoryLookups, LookupAnswer, PullerConstraints
from kvloop.agents.connector.events import KvloopBlocksRetained, KvloopRetentionReleased
from kvloop.agents.connector.host.eviction import LRU, POLICIES, EvictionPolicy, eviction_policy, room_wanted
from kvloop.agents.sidecar.link import DirectoryLink
from kvloop.agents.sidecar.mirror import WorkerMirror
from kvloop.clients.bench.common import rss_bytes
from kvloop.clients.bench.cpu import CpuMeter
from kvloop.clients.bench.replay.trace import TraceRequest
from kvloop.clients.directory_client import AsyncDirectoryClient
from kvloop.common.held_blocks import HeldBlocks
from kvloop.common.host_names import HOST_SUFFIX
from kvloop.common.outcomes import path_name, reason_name
from kvloop.common.tokens import agreeing_prefix_length
from kvloop.v1 import directory_pb2 as pb

MODEL = "replay-model"
TIERS = ("device", "host")
# A host-memory copy's retention handle: the device run's, with this suffix.
ROUTINGS = ("kvloop", "round_robin", "random")
_HASH_LENGTH = 32  # sha256_cbor digests
# A lease the daemon never sees end before the decode withdraws the run (trace time runs apart
# from the daemon's clock).
_DAEMON_LEASE_MS = 7 * 24 * 3600 * 1000
# Reasons the daemon gives for not pulling blocks a decode holds (the rest are attributed from what
# the fleet knows: the run was withdrawn at its lease end, or evicted).
_DAEMON_MISS_REASONS = frozenset(
    {
        "below_threshold",
        "recompute_faster",
        "claimed",
        "peer_unavailable",
        "incompatible_layout",
        "disabled",
        "directory_resyncing",
        "window_not_held",
    }
)


@dataclass(frozen=True)
class FleetConfig:
    prefills: int = 2
    decodes: int = 4
    block_size: int = 32
    # Decode KV memory set aside for retained runs, in blocks, per decode.
    retention_blocks: int = 50_000
    # Decode host memory that takes the runs the device evicts, in blocks, per decode (0: no host tier).
    host_retention_blocks: int = 0
    # Which runs the host pool evicts first (the connector's kvloop_host_eviction policies).
    host_eviction: str = LRU
    # The host pool holds a block once, however many runs hold it (as the connector's does); False:
    # each run's blocks apart (a pool that copies every run whole), for comparison.
    host_pool_shared: bool = True
    # Retention lease (vLLM's decoder_kv_blocks_ttl, 480 s) and the puller's margin (connector's 6 s).
    lease_s: float = 480.0
    expiry_margin_s: float = 6.0
    # Prefill prefix-cache capacity in blocks, per prefill (0: prefix caching off).
    prefill_cache_blocks: int = 20_000
    routing: str = "kvloop"
    min_pull_tokens: int = 64
    kv_bytes_per_token: int = 131_072
    # Decode time per output token, to place a turn's end (and its retention) in trace time.
    decode_ms_per_token: float = 20.0
    # Trace time x speedup = wall time; 0: as fast as possible.
    speedup: float = 0.0
    max_wall_s: float | None = None
    # The connector's deadline is 20 ms; the replay's default is generous so that a loaded host
    # does not turn into `directory_unavailable` misses that would not happen on a serving host.
    lookup_timeout_ms: float = 10_000.0
    seed: int = 1
    # Decode crashes spread evenly over the trace (decodes in turn): the worker's stream closes, its
    # runs and running turns are lost, it rejoins with a new epoch after the downtime (trace s).
    decode_failures: int = 0
    failure_downtime_s: float = 60.0
    # Ask kvloopd's Route for every request, as kvloop's proxy does before it picks a prefill (the
    # prompt as block hashes, the prefills as candidates). The prefill is still picked by the
    # replay's own routing, so the shares do not depend on it; it is there for Route's cost.
    route: bool = True


@dataclass(slots=True)
class RequestRecord:
    index: int
    t_ms: float
    prefill: str
    decode: str
    prompt_tokens: int
    local_tokens: int
    pulled_tokens: int
    recomputed_tokens: int
    path: str
    reason: str
    # Prompt tokens some decode had held that were neither local nor pulled, and why.
    missed_tokens: int
    missed_reason: str
    # Prompt tokens a decode had held at some point before this request (its continuation share).
    ever_held_tokens: int
    lookup_ms: float
    route_ms: float = 0.0
    holder: str = ""
    pulled_tier: str = ""  # "device" or "host" when blocks were pulled


@dataclass(slots=True)
class _Run:
    handle: str
    hashes: list[bytes]
    extra_blocks: int  # blocks without a reusable hash (the answer nobody resends, partial blocks)
    withdraw_ms: float  # trace time the decode withdraws it (its lease end less the puller's margin)
    expire_ms: float  # trace time its lease ends
    tier: str = "device"
    servable: bool = True
    freed: bool = False
    retained_ms: float = 0.0  # trace time its turn ended


@dataclass
class _Pool:
    """One tier of a decode's retention memory, holding what common/held_blocks.py says a pool holds
    (blocks of equal hash once, as vLLM's KV cache and the connector's host pool do; a run's blocks
    without a reusable hash are its own); runs oldest first; with an eviction policy (the host
    tier), the policy knows every run it holds."""

    capacity: int
    blocks: HeldBlocks[Hashable] = field(default_factory=HeldBlocks)
    runs: OrderedDict[str, _Run] = field(default_factory=OrderedDict)  # oldest first
    next_slot: int = 0
    policy: EvictionPolicy | None = None
    shared: bool = True  # False: each run's blocks apart, however many runs hold the same

    @property
    def used(self) -> int:
        return len(self.blocks)

    def need(self, run_hashes: list[bytes], extra: int) -> int:
        """Blocks a run with these hashes takes beyond what the pool holds already."""
        if not self.shared:
            return len(dict.fromkeys(run_hashes)) + extra
        return len(self.blocks.missing(run_hashes)) + extra

    def add(self, run: _Run) -> list[int]:
        """Hold the run; its block (slot) ids."""
        hashes: list[Hashable] = list(run.hashes) if self.shared else [(run.handle, h) for h in run.hashes]
        self.blocks.hold(run.handle, [*hashes, *((run.handle, i) for i in range(run.extra_blocks))])
        self.runs[run.handle] = run
        if self.policy is not None:
            self.policy.add(run.handle, run.hashes, run.retained_ms / 1000)
        ids = [(self.next_slot + i) % self.capacity for i in range(len(run.hashes))]
        self.next_slot = (self.next_slot + len(run.hashes)) % self.capacity
        return ids

    def remove(self, run: _Run) -> None:
        self.runs.pop(run.handle, None)
        if self.policy is not None:
            self.policy.forget(run.handle)
        self.blocks.release(run.handle)

    def free(self, run: _Run) -> None:
        if not run.freed:
            run.freed = True
            self.remove(run)

    def make_room(self, run: _Run, at_s: float) -> list[_Run]:
        """Free the runs the pool gives up before it holds ``run``, as the connector's does: below
        a low share of free blocks, down to a target share, in its eviction policy's order."""
        out = []
        want = room_wanted(self.capacity - self.used, self.need(run.hashes, run.extra_blocks), self.capacity)
        while want and self.runs:
            victims = iter(self.policy.victims(at_s) if self.policy is not None else list(self.runs))
            while self.capacity - self.used < want and self.runs:
                victim = self.runs[next(victims)]
                self.free(victim)
                out.append(victim)
            # blocks ``run`` would have shared left with a victim: another round if it lacks room now
            # (the connector's, once the victims' fences passed)
            need = self.need(run.hashes, run.extra_blocks)
            want = (
                room_wanted(self.capacity - self.used, need, self.capacity)
                if need > self.capacity - self.used
                else 0
            )
        return out

    def supersede(self, run: _Run) -> list[_Run]:
        """Free the runs whose blocks ``run`` starts with (its conversation's earlier turns): the
        host pool releases them once it holds ``run``, as the connector's does."""
        out = [
            old
            for old in self.runs.values()
            if old is not run and agreeing_prefix_length(run.hashes, old.hashes) == len(old.hashes)
        ]
        for old in out:
            self.free(old)
        return out

    def clear(self) -> None:
        for handle in self.runs:
            if self.policy is not None:
                self.policy.forget(handle)
        self.runs.clear()
        self.blocks.clear()


@dataclass
class _Decode:
    worker_id: str
    mirror: WorkerMirror
    link: DirectoryLink
    device: _Pool
    host: _Pool
    active: int = 0
    inflight: set[int] = field(default_factory=set)  # request indexes decoding here
    down: bool = False
    runner: asyncio.Task | None = None
    lag_tasks: set[asyncio.Task] = field(default_factory=set)  # acks awaited on this stream
    failures: int = 0
    retained_runs: int = 0
    evicted_runs: int = 0
    not_retained: int = 0
    moved_to_host_runs: int = 0
    host_evicted_runs: int = 0
    host_superseded_runs: int = 0

    @property
    def used(self) -> int:
        return self.device.used


@dataclass
class _Prefill:
    worker_id: str
    mirror: WorkerMirror
    link: DirectoryLink
    lookups: DirectoryLookups
    cache: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # least recent first


@dataclass
class FleetResult:
    records: list[RequestRecord]
    wall_s: float
    truncated: bool
    event_lag_ms: list[float]
    rss_samples: list[tuple[float, int]]  # (trace ms, daemon RSS bytes)
    decodes: dict[str, dict[str, int]]
    behind_ms_max: float
    # kvloopd's events ingested during the replay (its GetStats counter, end less start)
    events_ingested: int = 0
    # What the fleet published during the replay, by kind (stored, removed, retained_device,
    # retained_host, released): protocol events, and the blocks they name (a release: its run's).
    events_by_kind: dict[str, int] = field(default_factory=dict)
    blocks_by_kind: dict[str, int] = field(default_factory=dict)


class Fleet:
    def __init__(
        self,
        config: FleetConfig,
        replicas: Sequence[tuple[AsyncDirectoryClient, str]],
        daemon_pid: int | None,
        progress: Callable[[int], None] = lambda done: None,
        meter: CpuMeter | None = None,
    ) -> None:
        if config.routing not in ROUTINGS:
            raise ValueError(f"routing {config.routing!r}: choose from {', '.join(ROUTINGS)}")
        if config.host_eviction not in POLICIES:
            raise ValueError(f"host eviction {config.host_eviction!r}: choose from {', '.join(POLICIES)}")
        self.config = config
        # kvloopd replicas (a client and its address each) sharing one store: the workers' streams and
        # Lookups spread over them in turn, Routes too; one of them answers the fleet's own queries.
        self.replicas = list(replicas)
        self.client = self.replicas[0][0]
        self._route_turn = itertools.count()
        self.daemon_pid = daemon_pid
        self.progress = progress
        self.meter = meter
        self.rnd = random.Random(config.seed)
        bs = config.block_size
        kv_bytes_per_block = self._kv_bytes_per_block = config.kv_bytes_per_token * bs
        self.decodes = [self._decode(f"replay-decode-{i}") for i in range(config.decodes)]
        # decodes take the replicas from the first on, prefills after them
        constraints = lambda worker: PullerConstraints(  # noqa: E731
            model=MODEL,
            requester=worker,
            block_size=bs,
            min_pull_tokens=config.min_pull_tokens,
            lease_margin_ms=0,  # applied in trace time by the decodes (module docstring)
            tensor_parallel_size=1,
            kv_dtype="bfloat16",
            kv_bytes_per_block=kv_bytes_per_block,
        )
        self.prefills = []
        for i in range(config.prefills):
            worker = f"replay-prefill-{i}"
            mirror = WorkerMirror(_HASH_LENGTH)
            client, target = self.replicas[(config.decodes + i) % len(self.replicas)]
            link = DirectoryLink(
                client, _registration(worker, pb.WORKER_ROLE_PREFILL, bs, kv_bytes_per_block), mirror.snapshot
            )
            lookups = DirectoryLookups(target, constraints(worker), timeout_ms=config.lookup_timeout_ms)
            self.prefills.append(_Prefill(worker, mirror, link, lookups))
        self._by_id = {d.worker_id: d for d in self.decodes}
        self._rr = itertools.count()
        self._rr_decode = itertools.count()
        # Ground truth: how many servable runs hold each hash, and why the last one stopped.
        self._held: dict[bytes, int] = defaultdict(int)
        self._gone: dict[bytes, str] = {}
        self._lags: list[float] = []
        self._events: list[tuple[float, int, str, _Decode, TraceRequest | _Run | None]] = []
        self._seq = itertools.count()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replay-lookup")
        self._events_by_kind: Counter[str] = Counter()
        self._blocks_by_kind: Counter[str] = Counter()

    def _decode(self, worker: str) -> _Decode:
        mirror = self._decode_mirror()
        registration = self._decode_registration(worker)
        return _Decode(
            worker,
            mirror,
            DirectoryLink(self._home(worker), registration, mirror.snapshot),
            device=_Pool(self.config.retention_blocks),
            host=_Pool(
                self.config.host_retention_blocks,
                policy=self._host_policy(),
                shared=self.config.host_pool_shared,
            ),
        )

    def _home(self, decode_worker: str) -> AsyncDirectoryClient:
        """The replica a decode's stream goes to (the same one after a restart)."""
        return self.replicas[int(decode_worker.rsplit("-", 1)[1]) % len(self.replicas)][0]

    def _host_policy(self) -> EvictionPolicy | None:
        """The connector's eviction policy for a decode's host pool; a copy is servable until the
        decode withdraws it (the lease less the puller's margin)."""
        cfg = self.config
        if not cfg.host_retention_blocks:
            return None
        return eviction_policy(cfg.host_eviction, cfg.lease_s - cfg.expiry_margin_s)

    def _decode_mirror(self) -> WorkerMirror:
        return WorkerMirror(_HASH_LENGTH, host_pool=self.config.host_retention_blocks > 0)

    def _decode_registration(self, worker: str) -> pb.WorkerRegistration:
        registration = _registration(
            worker, pb.WORKER_ROLE_DECODE, self.config.block_size, self._kv_bytes_per_block
        )
        if self.config.host_retention_blocks:
            # The host pool is a NIXL engine of its own (the connector's `<engine id>@host`).
            registration.host_engine_id = worker + HOST_SUFFIX
            registration.host_nixl_endpoint = "127.0.0.1:5601"
        return registration

    # ---- the replay loop ------------------------------------------------------------------------

    async def run(self, requests: list[TraceRequest]) -> FleetResult:
        links = [d.link for d in self.decodes] + [p.link for p in self.prefills]
        prefill_runners = [asyncio.create_task(p.link.run()) for p in self.prefills]
        for d in self.decodes:
            d.runner = asyncio.create_task(d.link.run())
        try:
            await asyncio.wait_for(asyncio.gather(*(link.connected.wait() for link in links)), 30)
            self._schedule_failures(requests)
            return await self._replay(requests)
        finally:
            runners = [*prefill_runners, *(d.runner for d in self.decodes if d.runner is not None)]
            lags = [t for d in self.decodes for t in d.lag_tasks]
            for task in [*lags, *runners]:
                task.cancel()
            await asyncio.gather(*runners, *lags, return_exceptions=True)
            for p in self.prefills:
                p.lookups.close()
            self._executor.shutdown(wait=False)

    async def _replay(self, requests: list[TraceRequest]) -> FleetResult:
        records: list[RequestRecord] = []
        rss: list[tuple[float, int]] = []
        t0 = requests[0].timestamp_ms if requests else 0.0
        wall0 = time.perf_counter()
        behind_max, truncated = 0.0, False
        rss_every = max(1, len(requests) // 50)
        events_before = (await self.client.stats()).events_ingested
        self._events_by_kind.clear()
        self._blocks_by_kind.clear()
        if self.meter is not None:
            self.meter.start()
        for n, request in enumerate(requests):
            await self._advance(request.timestamp_ms)
            if self.config.max_wall_s is not None and time.perf_counter() - wall0 > self.config.max_wall_s:
                truncated = True
                break
            if self.config.speedup > 0:
                due = wall0 + (request.timestamp_ms - t0) / 1000 / self.config.speedup
                ahead = due - time.perf_counter()
                if ahead > 0:
                    await asyncio.sleep(ahead)
                else:
                    behind_max = max(behind_max, -ahead * 1000)
            records.append(await self._arrive(request))
            if self.daemon_pid is not None and n % rss_every == 0:
                rss.append((request.timestamp_ms, rss_bytes(self.daemon_pid)))
            self.progress(n + 1)
        await self._settle()
        if self.meter is not None:
            self.meter.stop()
        events = (await self.client.stats()).events_ingested - events_before
        if self.daemon_pid is not None:
            rss.append((records[-1].t_ms if records else 0.0, rss_bytes(self.daemon_pid)))
        decodes = {
            d.worker_id: {
                "retained_runs": d.retained_runs,
                "evicted_runs": d.evicted_runs,
                "not_retained_too_large": d.not_retained,
                "blocks_in_use_at_end": d.used,
                "moved_to_host_runs": d.moved_to_host_runs,
                "host_evicted_runs": d.host_evicted_runs,
                "host_superseded_runs": d.host_superseded_runs,
                "host_blocks_in_use_at_end": d.host.used,
                "failures": d.failures,
            }
            for d in self.decodes
        }
        return FleetResult(
            records=records,
            wall_s=time.perf_counter() - wall0,
            truncated=truncated,
            event_lag_ms=self._lags,
            rss_samples=rss,
            decodes=decodes,
            behind_ms_max=behind_max,
            events_ingested=events,
            events_by_kind=dict(self._events_by_kind),
            blocks_by_kind=dict(self._blocks_by_kind),
        )

    def _schedule(self, t_ms: float, kind: str, decode: _Decode, what: TraceRequest | _Run | None) -> None:
        heapq.heappush(self._events, (t_ms, next(self._seq), kind, decode, what))

    async def _advance(self, until_ms: float) -> None:
        """Apply every fleet event (turn ends, withdrawals, lease ends) due by ``until_ms``."""
        while self._events and self._events[0][0] <= until_ms:
            t_ms, _, kind, decode, what = heapq.heappop(self._events)
            if isinstance(what, TraceRequest):  # the turn ended
                if what.index in decode.inflight:  # else lost in a crash
                    decode.inflight.discard(what.index)
                    decode.active -= 1
                    self._retain(decode, what, t_ms)
            elif isinstance(what, _Run):
                if kind == "withdraw" and what.servable:
                    self._unserve(decode, what, "expired")
                elif kind == "expire":
                    self._free(decode, what)
            elif kind == "crash":
                await self._crash(decode)
            else:
                await self._restart(decode)

    def _schedule_failures(self, requests: list[TraceRequest]) -> None:
        n = self.config.decode_failures
        if not n or not requests:
            return
        t0, t1 = requests[0].timestamp_ms, requests[-1].timestamp_ms
        for k in range(n):
            decode = self.decodes[k % len(self.decodes)]
            at = t0 + (k + 1) * (t1 - t0) / (n + 1)
            self._schedule(at, "crash", decode, None)
            self._schedule(at + self.config.failure_downtime_s * 1000, "restart", decode, None)

    async def _crash(self, decode: _Decode) -> None:
        """The worker and its sidecar die: the stream closes (kvloopd stops serving its runs), its
        runs and the turns it was decoding are lost."""
        if decode.down or len([d for d in self.decodes if not d.down]) == 1:
            return  # keep one decode up to take the turns
        decode.down = True
        decode.failures += 1
        stopped = [*decode.lag_tasks, *([decode.runner] if decode.runner is not None else [])]
        for task in stopped:
            task.cancel()
        await asyncio.gather(*stopped, return_exceptions=True)
        # What a lookup may depend on: kvloopd has seen the stream close.
        for _ in range(1000):
            workers = await self.client.list_workers(MODEL)
            if not any(w.registration.worker_id == decode.worker_id and w.connected for w in workers):
                break
            await asyncio.sleep(0.005)
        for pool in (decode.device, decode.host):
            for run in list(pool.runs.values()):
                if run.servable:
                    self._forget(run, "peer_unavailable")
                    run.servable = False
                run.freed = True
            pool.clear()
        decode.host.policy = self._host_policy()  # a new process learns afresh
        decode.active = 0
        decode.inflight.clear()

    async def _restart(self, decode: _Decode) -> None:
        """Back with an empty cache and a new epoch: kvloopd drops what it knew of the old one."""
        if not decode.down:
            return
        decode.mirror = self._decode_mirror()
        registration = self._decode_registration(decode.worker_id)
        decode.link = DirectoryLink(self._home(decode.worker_id), registration, decode.mirror.snapshot)
        decode.runner = asyncio.create_task(decode.link.run())
        await asyncio.wait_for(decode.link.connected.wait(), 30)
        decode.down = False

    async def _settle(self) -> None:
        await asyncio.gather(*(d.link.wait_acked(timeout=60) for d in self.decodes if not d.down))
        await asyncio.gather(*(p.link.wait_acked(timeout=60) for p in self.prefills))
        await asyncio.gather(*(t for d in self.decodes for t in d.lag_tasks), return_exceptions=True)

    # ---- a request ------------------------------------------------------------------------------

    async def _arrive(self, r: TraceRequest) -> RequestRecord:
        cfg, bs = self.config, self.config.block_size
        prefill = (
            self.prefills[next(self._rr) % len(self.prefills)]
            if cfg.routing != "random"
            else (self.rnd.choice(self.prefills))
        )
        local = 0
        for h in r.hashes:
            if h not in prefill.cache:
                break
            local += 1
        ever = 0
        for h in r.hashes:
            if h not in self._held and h not in self._gone:
                break
            ever += 1
        answer: LookupAnswer | None = None
        lookup_ms = route_ms = 0.0
        if r.hashes:
            # What a lookup may depend on has reached the daemon (module docstring). With a CPU
            # meter the prefills' events are awaited too: nothing else runs in the daemon while
            # the Route and the Lookup are measured.
            links = [d.link for d in self.decodes if not d.down]
            if self.meter is not None:
                links += [p.link for p in self.prefills]
            await asyncio.gather(
                *(link.wait_acked(timeout=60) for link in links if link.acked < link.sequence)
            )
            if cfg.route:
                t = time.perf_counter()
                with self._window("route"):
                    await self.replicas[next(self._route_turn) % len(self.replicas)][0].route(
                        MODEL,
                        [p.worker_id for p in self.prefills],
                        block_hashes=b"".join(r.hashes),  # packed, as the connector's Lookup sends them
                        hash_length=_HASH_LENGTH,
                        block_size=bs,
                        prompt_tokens=r.input_length,
                    )
                route_ms = (time.perf_counter() - t) * 1000
            loop = asyncio.get_running_loop()
            t = time.perf_counter()
            with self._window("lookup"):
                answer = await loop.run_in_executor(self._executor, prefill.lookups.lookup, r.hashes, local)
            lookup_ms = (time.perf_counter() - t) * 1000
        pulled_blocks, pulled_tier = 0, ""
        if answer is None:
            path = "recompute" if r.hashes else "miss"
            reason = "directory_unavailable" if r.hashes else "short_prompt"
        else:
            path, reason = path_name(answer.path), reason_name(answer.reason)
            if answer.path == pb.TURN_PATH_TRANSFER:
                pulled_blocks = max(0, answer.matched_blocks - local)
                pulled_tier = answer.holder.tier if answer.holder is not None else "device"
        served = local + pulled_blocks
        missed = max(0, ever - served)
        missed_reason = ""
        if missed:
            if reason in _DAEMON_MISS_REASONS or answer is None:
                missed_reason = reason
            else:
                missed_reason = self._gone.get(r.hashes[served], "other")
        prompt = r.input_length
        local_tokens = min(local * bs, prompt)
        pulled_tokens = min(pulled_blocks * bs, prompt - local_tokens)
        record = RequestRecord(
            index=r.index,
            t_ms=r.timestamp_ms,
            prefill=prefill.worker_id,
            decode="",
            prompt_tokens=prompt,
            local_tokens=local_tokens,
            pulled_tokens=pulled_tokens,
            recomputed_tokens=prompt - local_tokens - pulled_tokens,
            path=path,
            reason=reason,
            missed_tokens=missed * bs,
            missed_reason=missed_reason,
            ever_held_tokens=ever * bs,
            lookup_ms=lookup_ms,
            route_ms=route_ms,
            holder=answer.holder.worker_id if answer is not None and answer.holder is not None else "",
            pulled_tier=pulled_tier if pulled_tokens else "",
        )
        self._cache_prompt(prefill, r.hashes)
        decode = self._route_decode(record.holder)
        record.decode = decode.worker_id
        decode.active += 1
        decode.inflight.add(r.index)
        # The turn ends after its prefill and its answer; the cost of the prefill is the report's
        # business, so only decoding places the end here.
        self._schedule(r.timestamp_ms + r.output_length * cfg.decode_ms_per_token, "finish", decode, r)
        return record

    def _window(self, part: str) -> AbstractContextManager[object]:
        return self.meter.window(part) if self.meter is not None else nullcontext()

    def _route_decode(self, holder: str) -> _Decode:
        routing = self.config.routing
        up = [d for d in self.decodes if not d.down]
        if routing == "round_robin":
            return up[next(self._rr_decode) % len(up)]
        if routing == "random":
            return self.rnd.choice(up)
        # kvloop's proxy: the decode holding the conversation's blocks, else the least loaded.
        if holder in self._by_id and not self._by_id[holder].down:
            return self._by_id[holder]
        return min(up, key=lambda d: (d.active, d.used))

    def _cache_prompt(self, prefill: _Prefill, hashes: list[bytes]) -> None:
        capacity = self.config.prefill_cache_blocks
        if not capacity or not hashes:
            return
        cache, new = prefill.cache, []
        # vLLM frees a request's blocks tail first, so the tail is evicted before the head.
        for i in range(len(hashes) - 1, -1, -1):
            h = hashes[i]
            if h not in cache:
                new.append(i)
            cache[h] = None
            cache.move_to_end(h)
        evicted = []
        while len(cache) > capacity:
            evicted.append(cache.popitem(last=False)[0])
        new.reverse()
        # The engine's own events, shaped as vLLM publishes them: each evicted block on its own (its
        # block pool evicts one block at a time), then one BlockStored per stretch of newly cached
        # blocks, naming the block before it; the sidecar's mirror converts them.
        raw: list[dict] = [{"type": "BlockRemoved", "block_hashes": [h]} for h in evicted]
        kept = [i for i in new if hashes[i] in cache]
        for start, stop in _stretches(kept):
            raw.append(
                {
                    "type": "BlockStored",
                    "block_hashes": hashes[start:stop],
                    "parent_block_hash": hashes[start - 1] if start else None,
                }
            )
        events = prefill.mirror.convert_batch(raw, ())
        if events:
            self._count(events)
            prefill.link.publish(events)

    # ---- decode retention -----------------------------------------------------------------------

    def _retain(self, decode: _Decode, r: TraceRequest, t_ms: float) -> None:
        cfg, pool = self.config, decode.device
        hashes = r.held
        if not hashes:
            return
        extra = max(0, -(-r.held_tokens // cfg.block_size) - len(hashes))
        if decode.host.policy is not None:
            decode.host.policy.turn(hashes, t_ms / 1000)
        if pool.need(hashes, extra) > pool.capacity:
            decode.not_retained += 1
            return
        # What the connector announces in this engine step (the runs it gave up to make room, then
        # the new run) goes in one batch, as the engine's events of one step do.
        batch: list[pb.BlockEvent] = []
        while pool.used + pool.need(hashes, extra) > pool.capacity and pool.runs:
            _, oldest = pool.runs.popitem(last=False)
            decode.evicted_runs += 1
            self._free(decode, oldest)
            if oldest.servable:
                self._evict(decode, oldest, t_ms, batch)
        servable_for = cfg.lease_s - cfg.expiry_margin_s
        run = _Run(
            f"{decode.worker_id}/r{r.index}",
            list(hashes),
            extra,
            withdraw_ms=t_ms + servable_for * 1000,
            expire_ms=t_ms + cfg.lease_s * 1000,
            retained_ms=t_ms,
        )
        event = self._announce(decode, run, pool.add(run))
        decode.retained_runs += 1
        if event is not None and servable_for > 0:
            self._publish(decode, [*batch, event])
            for h in dict.fromkeys(hashes):
                self._held[h] += 1
                self._gone.pop(h, None)
            self._schedule(run.withdraw_ms, "withdraw", decode, run)
        else:
            run.servable = False
            if batch:
                self._publish(decode, batch)
        self._schedule(run.expire_ms, "expire", decode, run)

    def _evict(self, decode: _Decode, run: _Run, t_ms: float, batch: list[pb.BlockEvent]) -> None:
        """The device gave up a servable run: it moves to the host pool if the decode has one that
        can take it before the run's withdrawal, else it is dropped (the changes go in ``batch``)."""
        host = decode.host
        if (
            not host.capacity
            or run.withdraw_ms <= t_ms
            or host.need(run.hashes, run.extra_blocks) > host.capacity
        ):
            self._unserve(decode, run, "evicted", batch)
            return
        for victim in host.make_room(run, t_ms / 1000):
            decode.host_evicted_runs += 1
            if victim.servable:
                self._unserve(decode, victim, "evicted", batch)
        copy = _Run(
            run.handle + HOST_SUFFIX,
            run.hashes,
            run.extra_blocks,
            withdraw_ms=run.withdraw_ms,
            expire_ms=run.expire_ms,
            tier="host",
            retained_ms=run.retained_ms,
        )
        event = self._announce(decode, copy, host.add(copy))
        decode.moved_to_host_runs += 1
        if event is None:
            copy.servable = False
            self._unserve(decode, run, "evicted", batch)
        else:
            # The copy serves the blocks the device run served: no block changes hands in the
            # ground truth, and the daemon gets both changes in one batch.
            batch.append(event)
            run.servable = False
            batch.append(self._released(decode, run, "moved"))
            self._schedule(copy.withdraw_ms, "withdraw", decode, copy)
            for old in host.supersede(copy):
                decode.host_superseded_runs += 1
                if old.servable:
                    self._unserve(decode, old, "superseded", batch)
        self._schedule(copy.expire_ms, "expire", decode, copy)

    def _announce(self, decode: _Decode, run: _Run, block_ids: list[int]) -> pb.BlockEvent | None:
        """The connector's event for a retained run, converted by the sidecar's mirror (as its
        forwarding does: packed)."""
        return decode.mirror.convert_kvloop(
            KvloopBlocksRetained(
                block_hashes=run.hashes,
                block_ids=[block_ids],
                retention_handle=run.handle,
                lease_ms=_DAEMON_LEASE_MS,
                single_use=False,
                ts=time.time(),
                tier=run.tier,
            ),
            packed=True,
        )

    def _released(self, decode: _Decode, run: _Run, why: str) -> pb.BlockEvent:
        event = decode.mirror.convert_kvloop(
            KvloopRetentionReleased(retention_handle=run.handle, reason=why, ts=time.time())
        )
        assert event is not None  # a release always converts
        self._blocks_by_kind["released"] += len(run.hashes)  # its events are counted when published
        return event

    def _unserve(
        self, decode: _Decode, run: _Run, why: str, batch: list[pb.BlockEvent] | None = None
    ) -> None:
        """Withdraw the run from the directory (published now, or added to ``batch``)."""
        run.servable = False
        event = self._released(decode, run, why)
        if batch is None:
            self._publish(decode, [event])
        else:
            batch.append(event)
        self._forget(run, why)

    def _forget(self, run: _Run, why: str) -> None:
        """Ground truth: the run no longer serves its blocks; a block nobody serves is gone for `why`."""
        for h in _unref(self._held, run.hashes):
            self._gone[h] = why

    def _free(self, decode: _Decode, run: _Run) -> None:
        (decode.host if run.tier == "host" else decode.device).free(run)

    def _count(self, events: list[pb.BlockEvent]) -> None:
        """What the events name, by kind (the report's block events per request by kind)."""
        for event in events:
            kind = event.WhichOneof("event")
            if kind in ("stored", "removed", "retained"):
                body = getattr(event, kind)
                if kind == "retained":
                    kind = "retained_host" if body.tier == pb.BLOCK_TIER_HOST else "retained_device"
                blocks = len(body.block_hashes) + len(body.packed_block_hashes) // _HASH_LENGTH
                self._blocks_by_kind[kind] += blocks
            self._events_by_kind[kind or "none"] += 1

    def _publish(self, decode: _Decode, events: list[pb.BlockEvent]) -> None:
        self._count(events)
        sent = time.perf_counter()
        sequence = decode.link.publish(events)

        async def lag() -> None:
            await decode.link.wait_acked(sequence)
            self._lags.append((time.perf_counter() - sent) * 1000)

        task = asyncio.get_running_loop().create_task(lag())
        decode.lag_tasks.add(task)
        task.add_done_callback(decode.lag_tasks.discard)


def _stretches(positions: list[int]) -> list[tuple[int, int]]:
    """Ascending positions as [start, stop) stretches of consecutive ones."""
    out: list[tuple[int, int]] = []
    for i in positions:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _unref(counts: dict[bytes, int], hashes: list[bytes]) -> list[bytes]:
    """Drop one count of each distinct hash; the hashes left with none (and removed)."""
    gone = []
    for h in dict.fromkeys(hashes):
        left = counts[h] - 1
        if left:
            counts[h] = left
        else:
            del counts[h]
            gone.append(h)
    return gone


def _registration(worker: str, role: int, block_size: int, kv_bytes_per_block: int) -> pb.WorkerRegistration:
    return pb.WorkerRegistration(
        worker_id=worker,
        role=role,
        model=MODEL,
        engine_id=worker,
        nixl_endpoint="127.0.0.1:5600",
        block_size=block_size,
        hash_algorithm="sha256_cbor",
        hash_length=_HASH_LENGTH,
        kv_bytes_per_block=kv_bytes_per_block,
        kv_dtype="bfloat16",
        parallel=pb.ParallelLayout(tensor_parallel_size=1),
        epoch=random.getrandbits(63) | 1,
    )
