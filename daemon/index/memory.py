"""In-memory block directory.

Layout, chosen for lookup speed and memory per entry:
- blocks are keyed as kvloopd receives them: by their hash's leading 8 bytes (kvloop.common.block_keys;
  the service cuts every hash it is given), as on Redis;
- per namespace, ``retained`` maps a block key to the id of the retained run holding it (an int),
  or a list of run ids when several runs hold it (shared prefixes); ``stored`` does the same for
  prefix-cache blocks, with worker slots instead of run ids;
- a run keeps its block keys concatenated (one buffer: a lookup's binary search over the run touches
  one object, not a bytes object per probe) and its physical block ids packed as uint32s (as a Lookup
  sends them: a holder's ids are one slice), so an entry costs a key, a dict slot and 12 bytes.

Every retained run starts at the first block of its sequence and block hashes are chained, so the
runs holding block i of a prompt also hold blocks 0..i-1: "some servable run holds block i" is
monotone in i, and the longest servable prefix is found by binary search (O(log n) dict probes for
an n-block prompt) instead of a walk over every block. When one run alone holds the prompt's first new
block (the usual continuation), no other run can hold more, and that run's own hashes are compared
instead: no dict probes past the first.
"""

from __future__ import annotations

import heapq
import itertools
import struct
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence

from kvloop.common.packed_ids import pack_u32
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
from kvloop.daemon.index.store import Applied, DirectoryError, Fence, IndexConfig, StoreCounts

_ID = struct.Struct("<I")  # a packed block id (kvloop.common.packed_ids)
_ID_BYTES = _ID.size


class _Run:
    __slots__ = (
        "block_ids",
        "blocks",
        "claimed_by",
        "deadline",
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
        hashes = event.hashes
        self.blocks = len(hashes)
        self.width = len(hashes[0]) if hashes else 0
        self.keys = b"".join(hashes)
        if len(self.keys) != self.blocks * self.width:
            raise ValueError("a retained run's block hashes must all have one length")
        self.block_ids = pack_u32(event.block_ids)  # packed, as a Lookup sends them (4 bytes an id)
        self.num_groups = event.num_groups
        self.handle = event.handle
        self.deadline = now + event.expires_in_ms / 1000.0
        self.single_use = event.single_use
        self.claimed_by: str | None = None  # the puller a single-use run was handed to
        self.tier = event.tier or BlockTier.DEVICE
        self.generation = event.registration_generation
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

    def hashes(self) -> Iterator[bytes]:
        keys, w = self.keys, self.width
        return (keys[i : i + w] for i in range(0, len(keys), w))

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
        "slot",
        "spec",
        "state",
        "stored",
    )

    def __init__(self, spec: WorkerSpec, slot: int, now: float):
        self.spec = spec
        self.slot = slot
        self.state = LeaseState.ACTIVE
        self.connected = True
        self.last_seen = now
        self.last_sequence = 0
        self.runs: dict[str, _Run] = {}
        self.stored: dict[Namespace, set[bytes]] = {}
        self.events_ingested = 0
        self.resyncs = 0
        self.retained_blocks = 0
        self.generation = 0  # the highest registration generation its runs were announced under


class _NamespaceIndex:
    __slots__ = ("retained", "stored")

    def __init__(self) -> None:
        self.retained: dict[bytes, int | list[int]] = {}
        self.stored: dict[bytes, int | list[int]] = {}


def _add(index: dict, key: bytes, value: int) -> bool:
    current = index.get(key)
    if current is None:
        index[key] = value
        return True
    if type(current) is list:
        if value in current:
            return False
        current.append(value)
        return True
    if current == value:
        return False
    index[key] = [current, value]
    return True


def _discard(index: dict, key: bytes, value: int) -> bool:
    current = index.get(key)
    if current is None:
        return False
    if type(current) is list:
        try:
            current.remove(value)
        except ValueError:
            return False
        if len(current) == 1:
            index[key] = current[0]
        return True
    if current == value:
        del index[key]
        return True
    return False


def _values(entry: int | list[int]) -> Iterable[int]:
    return entry if isinstance(entry, list) else (entry,)


def _common_prefix(run: _Run, hashes: PackedHashes, known: int, n: int) -> int:
    """Blocks the run shares with the prompt, given that both hold block ``known``: chained hashes
    make equality at block i imply it for every block before i, so a binary search finds the end.
    The prompt is sliced inline: this runs on every continuation's Lookup."""
    keys, w = run.keys, run.width
    top = min(run.blocks, n) - 1
    data, pw = hashes.data, hashes.width  # pw == w within a namespace; each side sliced by its own
    # keys.startswith(key, offset): one slice a probe, compared in place (~15% of the search)
    if keys.startswith(data[top * pw : top * pw + pw], top * w):  # the usual continuation
        return top + 1
    lo, hi = known, top - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if keys.startswith(data[mid * pw : mid * pw + pw], mid * w):
            lo = mid
        else:
            hi = mid - 1
    return lo + 1


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
        self._slots: dict[int, _Worker] = {}
        self._next_slot = itertools.count(1)
        self._next_run = itertools.count(1)
        self._namespaces: dict[Namespace, _NamespaceIndex] = {}
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
        worker = _Worker(spec, next(self._next_slot), now)
        self._workers[spec.worker_id] = worker
        self._slots[worker.slot] = worker
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

    def _index(self, namespace: Namespace) -> _NamespaceIndex:
        index = self._namespaces.get(namespace)
        if index is None:
            index = self._namespaces[namespace] = _NamespaceIndex()
        return index

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
        index = self._index(namespace).retained
        rid = run.run_id
        # One probe per hash on the common path (no other holder yet); shared blocks take _add.
        before = len(index)
        claim = index.setdefault
        shared = [h for h in event.hashes if claim(h, rid) is not rid]
        added = len(index) - before
        # The run id is new, so it is in no holder list yet: append without _add's membership scan,
        # which walked the whole list of every shared block (a common system prompt is held by
        # every live run): ingest grew with the square of the runs sharing a prefix.
        # dict.fromkeys: a hash the event repeats must not add the run twice.
        for h in dict.fromkeys(shared) if shared else ():
            current = index[h]
            if isinstance(current, list):
                current.append(rid)
            else:
                index[h] = [current, rid]
            added += 1
        self._runs[rid] = run
        worker.runs[event.handle] = run
        worker.retained_blocks += len(event.hashes)
        heapq.heappush(self._expiry_heap, (run.deadline, rid))
        self._entries += added
        return touched + len(event.hashes)

    def _drop_run(self, run: _Run) -> int:
        if self._runs.pop(run.run_id, None) is None:
            return 0
        index = self._namespaces[run.namespace].retained
        rid = run.run_id
        removed = sum(_discard(index, h, rid) for h in run.hashes())
        self._entries -= removed
        worker = run.worker
        if worker.runs.get(run.handle) is run:
            del worker.runs[run.handle]
        worker.retained_blocks -= run.blocks
        return run.blocks

    def _store(self, worker: _Worker, event: Stored) -> int:
        namespace = Namespace(worker.spec.model, event.lora_name)
        index = self._index(namespace).stored
        mine = worker.stored.setdefault(namespace, set())
        slot = worker.slot
        added = 0
        for h in event.hashes:
            if h not in mine:
                mine.add(h)
                added += _add(index, h, slot)
        self._entries += added
        return len(event.hashes)

    def _remove(self, worker: _Worker, event: Removed) -> int:
        namespace = Namespace(worker.spec.model, event.lora_name)
        mine = worker.stored.get(namespace)
        if not mine:
            return 0
        index = self._namespaces[namespace].stored
        removed = 0
        for h in event.hashes:
            if h in mine:
                mine.discard(h)
                removed += _discard(index, h, worker.slot)
        self._entries -= removed
        return removed

    def _purge(self, worker: _Worker) -> int:
        touched = sum(self._drop_run(run) for run in list(worker.runs.values()))
        for namespace, hashes in worker.stored.items():
            index = self._namespaces[namespace].stored
            removed = sum(_discard(index, h, worker.slot) for h in hashes)
            self._entries -= removed
            touched += removed
        worker.stored.clear()
        return touched

    def _drop_worker(self, worker: _Worker) -> None:
        self._purge(worker)
        self._workers.pop(worker.spec.worker_id, None)
        self._model_specs.clear()
        self._slots.pop(worker.slot, None)

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
                for namespace, hashes in worker.stored.items():
                    index = self._namespaces[namespace].stored
                    while hashes and self._entries > target:
                        self._entries -= _discard(index, hashes.pop(), worker.slot)
                        self.evictions += 1

    # ---- queries -----------------------------------------------------------------------------

    def _servable(self, run: _Run, floor: float, now: float, requester: str) -> bool:
        worker = run.worker
        return (
            run.deadline > floor
            and run.claimed_by is None
            and worker.connected
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
        check) takes its worker."""
        ns = self._namespaces.get(namespace)
        if isinstance(hashes, PackedHashes):  # a Lookup's prompt
            prompt = hashes
        elif local_blocks < len(hashes):  # other callers' hashes, packed once here
            prompt = PackedHashes(b"".join(hashes), len(hashes[0]))
        else:
            return PrefixMatch(None, [])
        n, w = prompt.n, prompt.width
        data = prompt.data  # sliced inline: no call per probe
        if ns is None or local_blocks >= n:
            return PrefixMatch(None, [])
        key = data[local_blocks * w : local_blocks * w + w]
        index = ns.retained
        runs = self._runs
        first = index.get(key)
        if first is None:
            return PrefixMatch(None, [])
        floor = now + max(self.config.expiry_margin_s, margin_s)
        if isinstance(first, int):
            # Runs start at their sequence's first block and hashes chain, so a run holding any later
            # block of this prompt also holds this one: a single holder here is the only candidate,
            # and its match is found by comparing its own hashes (no index probes).
            run = runs[first]
            rw = run.width
            if (
                run.blocks > local_blocks
                and run.keys[local_blocks * rw : local_blocks * rw + rw] == key
                and self._servable(run, floor, now, requester)
                and (accept is None or accept(run.worker.spec))
            ):
                best = self._holding(run, _common_prefix(run, prompt, local_blocks, n), now)
                if claim and run.single_use:
                    run.claimed_by = requester
                return PrefixMatch(best, [])
        verdicts: dict[int, bool] = {}  # probes mostly hit the same few runs: judge each once
        accepted: dict[str, bool] = {}

        def servable(rid: int) -> bool:
            verdict = verdicts.get(rid)
            if verdict is None:
                run = runs[rid]
                verdict = self._servable(run, floor, now, requester)
                if verdict and accept is not None:
                    worker_id = run.worker.spec.worker_id
                    if worker_id not in accepted:
                        accepted[worker_id] = accept(run.worker.spec)
                    verdict = accepted[worker_id]
                verdicts[rid] = verdict
            return verdict

        def any_servable(position: int) -> bool:
            entry = index.get(data[position * w : position * w + w])
            if entry is None:
                return False
            if isinstance(entry, int):
                return servable(entry)
            return any(map(servable, entry))

        if not any_servable(local_blocks):
            held = [runs[r] for r in _values(first)]
            return PrefixMatch(None, [], self._why_unservable(held, floor, now, requester, accepted))
        lo, hi = local_blocks, n - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if any_servable(mid):
                lo = mid
            else:
                hi = mid - 1
        matched = lo + 1
        last = data[lo * w : lo * w + w]
        candidates = [
            run
            for rid in _values(index[last])
            if servable(rid)
            and (run := runs[rid]).blocks >= matched
            and run.keys[lo * run.width : matched * run.width] == last
        ]
        if not candidates:
            return PrefixMatch(None, [])
        # At equal reach a device run before a host one (its READ is the cheaper), then the longest-lived.
        candidates.sort(key=lambda r: (r.tier != BlockTier.DEVICE, -r.deadline))
        best = candidates[0]
        if claim and best.single_use:
            best.claimed_by = requester
        return PrefixMatch(
            self._holding(best, matched, now),
            [self._holding(r, matched, now) for r in candidates[1:8]],
        )

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
        """Leading prompt blocks each worker holds in its prefix cache: one walk over the prompt for
        all of them, ending when none holds the next block (a block evicted mid-prefix ends a run,
        as it ends vLLM's own prefix hit)."""
        out = dict.fromkeys(workers, 0)
        ns = self._namespaces.get(namespace)
        slots = {
            w.slot: w.spec.worker_id
            for name in workers
            if (w := self._workers.get(name)) is not None and self._serving(w, now)
        }
        if ns is None or not slots:
            return out
        index = ns.stored
        alive = set(slots)
        # Per block only the probe and a membership test: a worker's count is written once, where its
        # run of held blocks ends (most prompts are hundreds of blocks, held by one or two workers).
        for position, h in enumerate(hashes):
            entry = index.get(h)
            if entry is None:
                dropped = alive
            elif isinstance(entry, int):
                if entry in alive and len(alive) == 1:
                    continue
                dropped = alive - {entry}
            else:
                dropped = alive.difference(entry)
                if not dropped:
                    continue
            for slot in dropped:
                out[slots[slot]] = position
            alive = alive - dropped
            if not alive:
                break
        else:
            for slot in alive:
                out[slots[slot]] = len(hashes)
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
        )
        if run.tail is not None and matched == run.blocks:
            holding.tail_token_ids, holding.tail_block_ids = run.tail
        return holding

    async def find(self, namespace: Namespace, block_hash: bytes, now: float) -> list[Location]:
        ns = self._namespaces.get(namespace)
        if ns is None:
            return []
        floor = now + self.config.expiry_margin_s
        found = []
        for rid in _values(ns.retained.get(block_hash, [])):
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
        for slot in _values(ns.stored.get(block_hash, [])):
            worker = self._slots[slot]
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
