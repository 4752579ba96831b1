"""In-memory block directory.

Layout, chosen for the cost per event and per lookup:
- blocks are keyed as kvloopd receives them: by their hash's leading 8 bytes (kvloop.common.block_keys;
  the service cuts every hash it is given), as on Redis;
- retained runs are indexed per namespace as a tree of chains (:mod:`.chains`): a run is a path of a
  few nodes, so announcing or releasing one costs a walk down that path, not a dict operation per
  block, and a lookup walks the prompt's path and judges only the runs that reach furthest;
- a run keeps its block keys concatenated (one buffer, which the tree's nodes slice) and its physical
  block ids packed as uint32s (as a Lookup sends them: a holder's ids are one slice);
- a worker's prefix-cache blocks are a set of keys per namespace, changed a whole event at a time by
  the set's own (C) update, and read for Route one worker at a time (its leading blocks of the
  prompt, a scan in C that stops at the first block it lacks).
"""

from __future__ import annotations

import heapq
import itertools
import struct
import time
from array import array
from collections.abc import Callable, Sequence
from itertools import takewhile

from kvloop.daemon.index.chains import Chains
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
    hash_list,
    packed,
    packed_block_ids,
)
from kvloop.daemon.index.store import Applied, DirectoryError, Fence, IndexConfig, StoreCounts

_ID = struct.Struct("<I")  # a packed block id (kvloop.common.packed_ids)
_ID_BYTES = _ID.size


class _Run:
    __slots__ = (
        "block_ids",
        "blocks",
        "claimed_by",
        "deadline",
        "digests",
        "generation",
        "handle",
        "keys",
        "namespace",
        "num_groups",
        "run_id",
        "single_use",
        "tail",
        "tier",
        "width",
        "worker",
    )

    def __init__(self, run_id: int, worker: _Worker, namespace: Namespace, event: Retained, now: float):
        self.run_id = run_id
        self.worker = worker
        self.namespace = namespace
        self.keys, self.width = packed(event.hashes)
        self.blocks = len(self.keys) // self.width if self.width else 0
        self.block_ids = packed_block_ids(event.block_ids)  # 4 bytes an id, as a Lookup sends them
        self.num_groups = event.num_groups
        self.handle = event.handle
        self.deadline = now + event.expires_in_ms / 1000.0
        self.single_use = event.single_use
        self.claimed_by: str | None = None  # the puller a single-use run was handed to
        self.tier = event.tier or BlockTier.DEVICE
        self.generation = event.registration_generation
        self.digests = event.digests
        # (token ids, block id per group) of the partly filled last block; None for most runs' cost
        self.tail = (
            (array("I", event.tail_token_ids), array("I", event.tail_block_ids))
            if event.tail_token_ids
            else None
        )

    def ids_for(self, blocks: int) -> bytes:
        """Packed ids of blocks [0, blocks), group-major (byte slices: no per-id Python work)."""
        ids = self.block_ids
        if self.num_groups == 1:
            return ids[: blocks * _ID_BYTES]
        length = self.blocks * _ID_BYTES
        return b"".join(ids[g * length : g * length + blocks * _ID_BYTES] for g in range(self.num_groups))

    def position(self, key: bytes) -> int:
        """The block index of ``key`` in the run (-1: not held)."""
        keys, w = self.keys, self.width
        at = keys.find(key)
        while at != -1 and at % w:  # a match across two blocks' bytes is not a block
            at = keys.find(key, at + 1)
        return -1 if at == -1 else at // w


class _Worker:
    __slots__ = (
        "connected",
        "events_ingested",
        "generation",
        "last_seen",
        "last_sequence",
        "resyncs",
        "retained_blocks",
        "runs",
        "spec",
        "state",
        "stored",
        "unverified",
    )

    def __init__(self, spec: WorkerSpec, now: float):
        self.spec = spec
        self.state = LeaseState.ACTIVE
        self.connected = True
        self.last_seen = now
        self.last_sequence = 0
        self.runs: dict[str, _Run] = {}
        self.stored: dict[Namespace, set[bytes]] = {}  # the keys of its prefix-cache blocks
        self.events_ingested = 0
        self.resyncs = 0
        self.retained_blocks = 0
        self.generation = 0  # the highest registration generation its runs were announced under
        # A puller's READ from it failed its digest check: none of its runs is handed out until it
        # registers again.
        self.unverified = False


class MemoryStore:
    """The DirectoryStore of a single kvloopd process (soft state rebuilt from agents).

    Its coroutines never await, so each call is atomic on the event loop."""

    name = "memory"
    epoch = 0  # one process: nothing to fail over to
    in_process = True

    def __init__(self, config: IndexConfig | None = None) -> None:
        self.config = config or IndexConfig()
        self.clock: Callable[[], float] = time.monotonic  # the store's clock (no wrapper call per request)
        self._workers: dict[str, _Worker] = {}
        # model -> a registered worker's spec, for model_spec on every Lookup without a scan of
        # the workers; forgotten whenever a worker registers or is dropped
        self._model_specs: dict[str, WorkerSpec] = {}
        self._next_run = itertools.count(1)
        # (namespace, key width) -> its runs' tree; a key of another width never matches one of them
        self._chains: dict[tuple[Namespace, int], Chains] = {}
        self._runs: dict[int, _Run] = {}  # insertion order = age, for eviction
        self._expiry_heap: list[tuple[float, int]] = []
        self._entries = 0
        self.evictions = 0
        self.events_ingested = 0
        self.expired_runs = 0

    async def close(self) -> None:
        pass

    async def counts(self) -> StoreCounts:
        return StoreCounts(
            entries=self._entries,
            retained_runs=len(self._runs),
            events_ingested=self.events_ingested,
            evictions=self.evictions,
            expired_runs=self.expired_runs,
        )

    # ---- registration and leases -------------------------------------------------------------

    async def register(self, spec: WorkerSpec, last_sequence: int, now: float) -> tuple[int, bool]:
        self._check_model_compatible(spec)
        self._model_specs.clear()
        worker = self._workers.get(spec.worker_id)
        # A live worker may be taken over only by its own agent (same epoch: a reconnect whose old
        # stream has not been noticed as closed yet); another agent waits for the lease to lapse.
        if (
            worker is not None
            and worker.spec.epoch != spec.epoch
            and worker.connected
            and now - worker.last_seen <= self.config.lease_s
        ):
            raise DirectoryError(
                "ALREADY_EXISTS",
                f"worker {spec.worker_id!r} is connected (epoch {worker.spec.epoch}, last seen "
                f"{now - worker.last_seen:.1f}s ago); another agent may take over only after its lease "
                f"({self.config.lease_s:.0f}s) lapses",
            )
        if worker is not None and worker.spec.epoch == spec.epoch:
            worker.spec = spec
            worker.connected = True
            worker.last_seen = now
            worker.unverified = False
            if last_sequence < worker.last_sequence:
                # The agent lost batches we applied (it restarted without a new epoch): start over.
                self._purge(worker)
                worker.state = LeaseState.RESYNCING
                return 0, True
            if worker.state != LeaseState.RESYNCING:
                worker.state = LeaseState.ACTIVE
            return worker.last_sequence, worker.state == LeaseState.RESYNCING
        if worker is not None:
            self._drop_worker(worker)
        worker = _Worker(spec, now)
        self._workers[spec.worker_id] = worker
        if last_sequence > 0:
            # The agent has sent events in this epoch that we do not have (daemon restart).
            worker.state = LeaseState.RESYNCING
            return 0, True
        return 0, False

    def _check_model_compatible(self, spec: WorkerSpec) -> None:
        for other in self._workers.values():
            if other.spec.model != spec.model or other.spec.worker_id == spec.worker_id:
                continue
            mine = (spec.block_size, spec.hash_algorithm, spec.hash_length)
            theirs = (other.spec.block_size, other.spec.hash_algorithm, other.spec.hash_length)
            if mine != theirs:
                raise DirectoryError(
                    "FAILED_PRECONDITION",
                    f"model {spec.model!r} is served with block_size={theirs[0]}, hash_algorithm="
                    f"{theirs[1]!r}, hash_length={theirs[2]} (worker {other.spec.worker_id!r}); worker "
                    f"{spec.worker_id!r} registered block_size={mine[0]}, hash_algorithm={mine[1]!r}, "
                    f"hash_length={mine[2]}: their block hashes would never match",
                )
            return

    async def disconnect(self, worker_id: str, epoch: int, now: float) -> None:
        worker = self._workers.get(worker_id)
        if worker is not None and worker.spec.epoch == epoch:
            worker.connected = False
            worker.last_seen = now

    async def heartbeat(self, worker_id: str, now: float) -> None:
        worker = self._workers[worker_id]
        worker.last_seen = now
        if worker.state == LeaseState.EXPIRED:
            worker.state = LeaseState.ACTIVE

    async def last_sequence(self, worker_id: str) -> int:
        return self._workers[worker_id].last_sequence

    async def worker_spec(self, worker_id: str) -> WorkerSpec | None:
        worker = self._workers.get(worker_id)
        return worker.spec if worker else None

    async def model_spec(self, model: str) -> WorkerSpec | None:
        """Any registered worker of the model (they agree on block size and hash layout)."""
        spec = self._model_specs.get(model)
        if spec is None:
            spec = next((w.spec for w in self._workers.values() if w.spec.model == model), None)
            if spec is not None:
                self._model_specs[model] = spec
        return spec

    async def mark_resyncing(self, worker_id: str) -> None:
        worker = self._workers[worker_id]
        worker.state = LeaseState.RESYNCING

    async def set_draining(self, worker_id: str) -> bool:
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        worker.state = LeaseState.DRAINING
        return True

    async def set_unverified(self, worker_id: str) -> bool:
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        worker.unverified = True
        return True

    def _serving(self, worker: _Worker, now: float) -> bool:
        return (
            worker.connected
            and worker.state == LeaseState.ACTIVE
            and now - worker.last_seen <= self.config.lease_s
        )

    # ---- events ------------------------------------------------------------------------------

    async def begin_snapshot(self, worker_id: str, now: float) -> None:
        worker = self._workers[worker_id]
        self._purge(worker)
        worker.state = LeaseState.RESYNCING
        worker.resyncs += 1
        worker.last_seen = now

    async def end_snapshot(self, worker_id: str, sequence: int, now: float) -> None:
        worker = self._workers[worker_id]
        worker.last_sequence = sequence
        worker.state = LeaseState.ACTIVE
        worker.last_seen = now

    async def apply(
        self, worker_id: str, epoch: int, sequence: int, events: Sequence[Event], now: float
    ) -> Applied:
        worker = self._workers.get(worker_id)
        if worker is None:
            return Applied(Fence.UNKNOWN_WORKER, 0)
        if worker.spec.epoch != epoch:
            return Applied(Fence.STALE_EPOCH, worker.last_sequence)
        if sequence:
            if sequence <= worker.last_sequence:
                return Applied(Fence.DUPLICATE, worker.last_sequence)
            if sequence != worker.last_sequence + 1:
                return Applied(Fence.GAP, worker.last_sequence)
        touched = 0
        for event in events:
            kind = type(event)
            if kind is Retained:
                touched += self._retain(worker, event, now)
            elif kind is Stored:
                touched += self._store(worker, event)
            elif kind is Removed:
                touched += self._remove(worker, event)
            elif kind is Released:
                run = worker.runs.get(event.handle)
                if run is not None:
                    touched += self._drop_run(run)
            elif kind is Cleared:
                touched += self._purge(worker)
        if sequence:
            worker.last_sequence = sequence
        worker.last_seen = now
        worker.events_ingested += touched
        self.events_ingested += touched
        if self._entries > self.config.max_entries:
            self._evict()
        return Applied(Fence.APPLIED, worker.last_sequence, touched)

    def _retain(self, worker: _Worker, event: Retained, now: float) -> int:
        generation = event.registration_generation
        if generation < worker.generation:
            return 0  # retained before the engine registered its KV cache again: freed memory
        touched = 0
        if generation > worker.generation:
            # The engine registered its KV cache again (vLLM's sleep and wake): every run announced
            # before names memory that was deregistered. Withdraw them before anyone reads them.
            worker.generation = generation
            for old in [r for r in worker.runs.values() if r.generation < generation]:
                touched += self._drop_run(old)
        previous = worker.runs.get(event.handle)
        if previous is not None:
            self._drop_run(previous)
        namespace = Namespace(worker.spec.model, event.lora_name)
        run = _Run(next(self._next_run), worker, namespace, event, now)
        if run.blocks:
            key = (namespace, run.width)
            chains = self._chains.get(key)
            if chains is None:
                chains = self._chains[key] = Chains(run.width)
            chains.insert(run.run_id, run.keys, run.blocks)
        self._runs[run.run_id] = run
        worker.runs[event.handle] = run
        worker.retained_blocks += run.blocks
        heapq.heappush(self._expiry_heap, (run.deadline, run.run_id))
        self._entries += run.blocks
        return touched + run.blocks

    def _drop_run(self, run: _Run) -> int:
        if self._runs.pop(run.run_id, None) is None:
            return 0
        if run.blocks:
            self._chains[run.namespace, run.width].remove(run.run_id, run.keys, run.blocks)
        self._entries -= run.blocks
        worker = run.worker
        if worker.runs.get(run.handle) is run:
            del worker.runs[run.handle]
        worker.retained_blocks -= run.blocks
        return run.blocks

    def _store(self, worker: _Worker, event: Stored) -> int:
        mine = worker.stored.setdefault(Namespace(worker.spec.model, event.lora_name), set())
        before = len(mine)
        mine.update(hash_list(event.hashes))
        self._entries += len(mine) - before
        return len(event.hashes)

    def _remove(self, worker: _Worker, event: Removed) -> int:
        mine = worker.stored.get(Namespace(worker.spec.model, event.lora_name))
        if not mine:
            return 0
        before = len(mine)
        mine.difference_update(hash_list(event.hashes))
        removed = before - len(mine)
        self._entries -= removed
        return removed

    def _purge(self, worker: _Worker) -> int:
        touched = sum(self._drop_run(run) for run in list(worker.runs.values()))
        for hashes in worker.stored.values():
            self._entries -= len(hashes)
            touched += len(hashes)
        worker.stored.clear()
        return touched

    def _drop_worker(self, worker: _Worker) -> None:
        self._purge(worker)
        self._workers.pop(worker.spec.worker_id, None)
        self._model_specs.clear()

    def _evict(self) -> None:
        """Drop the oldest retained runs until under the bound (stored blocks go last)."""
        target = int(self.config.max_entries * 0.95)
        while self._entries > target and self._runs:
            oldest = next(iter(self._runs.values()))
            self._drop_run(oldest)
            self.evictions += 1
        if self._entries > target:
            for worker in list(self._workers.values()):
                if self._entries <= target:
                    break
                for hashes in worker.stored.values():
                    while hashes and self._entries > target:
                        hashes.pop()
                        self._entries -= 1
                        self.evictions += 1

    # ---- queries -----------------------------------------------------------------------------

    def _servable(self, run: _Run, floor: float, now: float, requester: str) -> bool:
        worker = run.worker
        return (
            run.deadline > floor
            and run.claimed_by is None
            and worker.connected
            and not worker.unverified
            and worker.state == LeaseState.ACTIVE
            and now - worker.last_seen <= self.config.lease_s
            and worker.spec.worker_id != requester
        )

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
        """The longest prefix one servable run holds beyond ``local_blocks``.

        A run is servable when its lease outlives ``max(expiry_margin_s, margin_s)``, it is not
        claimed, its worker is live and not the requester, and ``accept`` (the caller's layout
        check) takes its worker. Among runs reaching as far, a device run before a host one (its
        READ is the cheaper), then the longest-lived, then the first announced."""
        if isinstance(hashes, PackedHashes):  # a Lookup's prompt
            prompt = hashes
        elif local_blocks < len(hashes):  # other callers' hashes, packed once here
            prompt = PackedHashes(b"".join(hashes), len(hashes[0]))
        else:
            return PrefixMatch(None, [])
        n = prompt.n
        chains = self._chains.get((namespace, prompt.width))
        if chains is None or local_blocks >= n:
            return PrefixMatch(None, [])
        levels = chains.walk(prompt.data, n)
        if not levels or levels[-1][1] <= local_blocks:
            return PrefixMatch(None, [])  # no run holds the first block wanted
        runs = self._runs
        floor = now + max(self.config.expiry_margin_s, margin_s)
        accepted: dict[str, bool] = {}  # the caller's layout verdict, once per worker

        def servable(rid: int) -> bool:
            run = runs[rid]
            if not self._servable(run, floor, now, requester):
                return False
            if accept is None:
                return True
            worker_id = run.worker.spec.worker_id
            verdict = accepted.get(worker_id)
            if verdict is None:
                verdict = accepted[worker_id] = accept(run.worker.spec)
            return verdict

        # From the deepest node up: the runs through a node that no deeper node holds reach exactly
        # as far as the prompt agrees with that node (each run is judged once).
        deeper: dict[int, None] = {}
        for node, reach in reversed(levels):
            if reach <= local_blocks:
                break
            found = [runs[rid] for rid in node.runs if rid not in deeper and servable(rid)]
            if found:
                if len(found) > 1:
                    found.sort(key=lambda r: (r.tier != BlockTier.DEVICE, -r.deadline))
                best = found[0]
                if claim and best.single_use:
                    best.claimed_by = requester
                return PrefixMatch(
                    self._holding(best, reach, now), [self._holding(r, reach, now) for r in found[1:8]]
                )
            deeper = node.runs
        # None servable: why, from the runs holding the first block wanted (the last node judged).
        held = [runs[rid] for rid in deeper]
        return PrefixMatch(None, [], self._why_unservable(held, floor, now, requester, accepted))

    def _why_unservable(
        self, held: list[_Run], floor: float, now: float, requester: str, accepted: dict[str, bool]
    ) -> str:
        if any(r.claimed_by is not None for r in held):
            return "claimed"
        if any(r.deadline <= floor for r in held):
            return "expired"
        if any(
            accepted.get(r.worker.spec.worker_id) is False and self._servable(r, floor, now, requester)
            for r in held
        ):
            return "incompatible_layout"
        return "peer_unavailable"

    async def stored_prefixes(
        self, namespace: Namespace, hashes: Sequence[bytes], workers: Sequence[str], now: float
    ) -> dict[str, int]:
        """Leading prompt blocks each worker holds in its prefix cache, counted until the first block
        it lacks (a block evicted mid-prefix ends a run, as it ends vLLM's own prefix hit): per
        worker one scan in C over the prompt's keys, which stops there."""
        out = dict.fromkeys(workers, 0)
        if not hashes:
            return out
        first = hashes[0]
        keys: list[bytes] | None = None  # cut once, for the first worker holding block 0
        for name in workers:
            worker = self._workers.get(name)
            if worker is None or not self._serving(worker, now):
                continue
            mine = worker.stored.get(namespace)
            if not mine or first not in mine:
                continue
            if keys is None:
                keys = hash_list(hashes)
            out[name] = len(list(takewhile(mine.__contains__, keys)))
        return out

    async def release_claim(self, namespace: Namespace, holder: str, handle: str, requester: str) -> bool:
        """Give a single-use run back to every puller; only its claimant may. Idempotent."""
        worker = self._workers.get(holder)
        run = worker.runs.get(handle) if worker is not None else None
        if run is None or run.namespace != namespace or run.claimed_by != requester:
            return False
        run.claimed_by = None
        return True

    def _holding(self, run: _Run, matched: int, now: float) -> Holding:
        holding = Holding(
            run.worker.spec,
            matched,
            run.handle,
            max(0, int((run.deadline - now) * 1000)),
            run.ids_for(matched),
            run.num_groups,
            run.single_use,
            tier=run.tier,
            registration_generation=run.generation,
            digests=run.digests,
        )
        if run.tail is not None and matched == run.blocks:
            holding.tail_token_ids, holding.tail_block_ids = run.tail
        return holding

    async def find(self, namespace: Namespace, block_hash: bytes, now: float) -> list[Location]:
        floor = now + self.config.expiry_margin_s
        found = []
        chains = self._chains.get((namespace, len(block_hash)))
        for rid in chains.holding(block_hash) if chains is not None else ():
            run = self._runs[rid]
            position = run.position(block_hash)
            length = run.blocks
            found.append(
                Location(
                    worker_id=run.worker.spec.worker_id,
                    kind="retained",
                    position=position,
                    block_ids=[
                        _ID.unpack_from(run.block_ids, (g * length + position) * _ID_BYTES)[0]
                        for g in range(run.num_groups)
                    ],
                    handle=run.handle,
                    expires_in_ms=max(0, int((run.deadline - now) * 1000)),
                    servable=self._servable(run, floor, now, ""),
                    tier=run.tier,
                )
            )
        for worker in self._workers.values():
            if block_hash in worker.stored.get(namespace, ()):
                found.append(Location(worker.spec.worker_id, "stored", -1, [], "", 0, False, 0))
        return found

    async def workers(self, now: float, model: str = "") -> list[WorkerView]:
        views = []
        for worker in self._workers.values():
            if model and worker.spec.model != model:
                continue
            state = worker.state
            if state == LeaseState.ACTIVE and not self._serving(worker, now):
                state = LeaseState.EXPIRED
            views.append(
                WorkerView(
                    spec=worker.spec,
                    state=state,
                    connected=worker.connected,
                    last_applied_sequence=worker.last_sequence,
                    stored_blocks=sum(len(s) for s in worker.stored.values()),
                    retained_blocks=worker.retained_blocks,
                    retained_runs=len(worker.runs),
                    last_seen_s_ago=max(0.0, now - worker.last_seen),
                    events_ingested=worker.events_ingested,
                    resyncs=worker.resyncs,
                )
            )
        return views

    async def models(self) -> list[str]:
        return sorted({w.spec.model for w in self._workers.values()})

    # ---- maintenance -------------------------------------------------------------------------

    async def reap(self, now: float) -> list[Change]:
        changes: list[Change] = []
        heap = self._expiry_heap
        if len(heap) > 2 * len(self._runs) + 1024:
            # Released and replaced runs leave their entry behind until its deadline (a lease of
            # minutes): under churn the heap would grow with the event rate, not with what is held.
            heap[:] = [(run.deadline, rid) for rid, run in self._runs.items()]
            heapq.heapify(heap)
        while heap and heap[0][0] <= now:
            _, rid = heapq.heappop(heap)
            run = self._runs.get(rid)
            if run is not None:
                blocks = self._drop_run(run)
                self.expired_runs += 1
                changes.append(
                    Change(
                        "expired",
                        run.worker.spec.worker_id,
                        run.worker.spec.model,
                        blocks,
                        f"retention {run.handle} lease ended",
                    )
                )
        for worker in list(self._workers.values()):
            idle = now - worker.last_seen
            if worker.state == LeaseState.ACTIVE and idle > self.config.lease_s:
                worker.state = LeaseState.EXPIRED
                changes.append(
                    Change(
                        "lease",
                        worker.spec.worker_id,
                        worker.spec.model,
                        0,
                        f"no message for {idle:.1f}s: blocks no longer served",
                    )
                )
            if (
                not worker.connected or worker.state == LeaseState.EXPIRED
            ) and idle > self.config.drop_after_s:
                blocks = worker.retained_blocks + sum(len(s) for s in worker.stored.values())
                self._drop_worker(worker)
                changes.append(
                    Change(
                        "dropped",
                        worker.spec.worker_id,
                        worker.spec.model,
                        blocks,
                        f"silent for {idle:.1f}s: entries dropped",
                    )
                )
        return changes
