"""The decode role of the kvloop connector's scheduler side: announce and release retained runs.

When a request finishes, vLLM's NixlConnector (``bidirectional_kv_xfer``) keeps its blocks for a
reverse pull; :meth:`DecodeSide.announce` tells the directory (through the KV-event stream the
sidecar forwards) which complete blocks, by chained hash, and which partly filled tail it holds,
and marks kvloop runs multi-reader so the worker keeps them until the lease ends instead of
freeing after one READ. :meth:`DecodeSide.released` reports each run vLLM frees.
:meth:`DecodeSide.admits` keeps retained runs within their share of the KV cache
(``retention_max_share``): live requests always keep the rest. Past ``YIELD_AT`` of that share the
oldest runs retained longer ago than ``retention_yield_after_s`` are given up (:mod:`.yielding`), so
newer turns fit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.config import KvloopConfig
from kvloop.agents.connector.events import KvloopBlocksRetained, KvloopRetentionReleased
from kvloop.agents.connector.host.tier import HostTier
from kvloop.agents.connector.metadata import HostCopy
from kvloop.agents.connector.yielding import YIELD_AT, GivenUp, ReleaseConfirmer
from kvloop.common.host_names import HOST_SUFFIX
from kvloop.common.sliding_window import NULL_BLOCK, first_needed_block

if TYPE_CHECKING:
    from vllm.v1.request import Request


# vLLM's null block (``BlockPool.null_block``, never a real KV block): in a retained run's group it
# marks a position whose KV the holder no longer has (out of a sliding window).


def aligned(groups: Any, num_blocks: int | None) -> list[list[int]]:
    """Each group's block ids by position: entry i is block i's id, NULL_BLOCK where not held.

    vLLM retains a finished request's blocks clipped per group (``get_exchange_clipped_blocks``): a
    full-attention group keeps every block, a sliding-window group only its last ones (the window,
    plus one), since the engine freed the rest while decoding. Clipped lists end at the request's
    last block, so they are right-aligned onto ``num_blocks`` positions (the longest list when
    unknown)."""
    lists = [list(g) for g in groups]
    total = max([len(g) for g in lists] + [num_blocks or 0])
    return [[NULL_BLOCK] * (total - len(g)) + g for g in lists]


def pinned_ids(block_ids: Any) -> set[int]:
    """The KV-cache blocks a finished request's groups hold (vLLM's null block is no block)."""
    return {b for group in block_ids for b in group if b != NULL_BLOCK}


@dataclass
class _Retained:
    deadline: float  # perf_counter
    since: float  # perf_counter when it was retained
    multi: bool  # kept until the lease ends (not freed by a READ's notice)
    pinned: set[int]  # block ids held until vLLM frees the run
    first_hash: bytes | None = None  # the announced run's first block (None: never announced)
    lora_name: str = ""
    given_up: bool = False  # its release went out before its lease ended (see yielding.py)
    settled: bool = False  # given up, and the directory's drop confirmed (or not, in time)
    generation: int = 0  # the engine's KV-cache registration generation when it was retained
    withdrawn: bool = False  # released because the engine registered its KV cache again


class DecodeSide:
    def __init__(
        self,
        cfg: KvloopConfig,
        block_size: int,
        emit: Callable[[Any], None],
        num_kv_blocks: int,
        confirmer: ReleaseConfirmer | None = None,
        host: HostTier | None = None,
        group_windows: Sequence[int] = (),
        generation: Callable[[], int] = lambda: 0,
    ) -> None:
        self.cfg = cfg
        # Each KV-cache group's sliding window in tokens (0: full attention), in vLLM's group order.
        self.group_windows = tuple(group_windows)
        # The KV-cache registration generation vLLM's NIXL scheduler publishes (compat.py; 0 before
        # vLLM 0.33), and the highest one seen: runs retained under an older one are withdrawn.
        self._generation = generation
        self.generation = 0
        # The host retention tier (host/tier.py): copies of retained runs that outlive their blocks here.
        self._host = host
        self.block_size = block_size
        self._emit = emit if cfg.publish_events else (lambda event: None)
        self._retained: dict[str, _Retained] = {}
        # Runs of one conversation share blocks (a later turn's prefix is an earlier turn's run,
        # found in vLLM's prefix cache), so what retention pins is counted per block id.
        self._pins: dict[int, int] = {}
        # The same count over the runs not given up: what retention holds once those are freed.
        self._kept: dict[int, int] = {}
        self.max_pinned = int(cfg.retention_max_share * num_kv_blocks)
        self._capped = False
        # Without one (no daemon to confirm a drop with), runs keep their lease: nothing is given up.
        self._confirmer = confirmer if cfg.publish_events else None
        self._yield_above = int(YIELD_AT * self.max_pinned)
        # Given-up runs the worker may free, and when (perf_counter): for the next step's metadata.
        self._free_early: dict[str, float] = {}
        # For the worker: runs announced this step that it keeps until their lease ends.
        self.multi_reader_new: set[str] = set()
        # Runs past the share admitted only to move to the host pool, and runs past it kept here until
        # their copy is made (see admits); what the latter may hold beyond the share: as much again,
        # never more than half of what the share leaves live requests.
        self._moving: set[str] = set()
        self._overflow: set[str] = set()
        self.max_in_transit = min(self.max_pinned, (num_kv_blocks - self.max_pinned) // 2)

    @property
    def pinned_blocks(self) -> int:
        """KV-cache blocks the retained runs hold between them."""
        return len(self._pins)

    def admits(self, block_ids: Any, request_id: str | None = None) -> bool:
        """Whether retaining a finished request that holds ``block_ids`` (its groups, as vLLM hands
        them to ``request_finished``) keeps retention within ``retention_max_share``.

        A request past the share goes to the host pool rather than being declined, as long as the pool
        could hold it: within ``max_in_transit`` blocks beyond the share it *overflows* (announced from
        the KV cache as usual, copied as soon as the pool has room, and given up once its copy is
        announced); past that, with room in the pool now, it *moves* (copied, never announced from the
        KV cache, freed once the copy is made)."""
        ids = pinned_ids(block_ids)
        added = sum(1 for b in ids if b not in self._pins)
        fits = self.pinned_blocks + added <= self.max_pinned
        if not fits and request_id is not None and self._to_pool(request_id, ids):
            return True
        if self._confirmer is not None and self.pinned_blocks + added > self._yield_above:
            self._give_up_oldest(ids)
        if fits == self._capped:
            self._capped = not fits
            # once per change, not per request: under pressure every finished request is declined
            tm.log.warning(
                "kvloop.retention_capped" if self._capped else "kvloop.retention_uncapped",
                pinned_blocks=self.pinned_blocks,
                max_pinned_blocks=self.max_pinned,
            )
        if not fits:
            tm.RETENTION_DECLINED.labels("capped").inc()
        return fits

    def _to_pool(self, request_id: str, ids: set[int]) -> bool:
        """Admit a request past the share on its way to the host pool (see :meth:`admits`). A run that
        overflows stays announced from here until its copy is announced, and its blocks are freed a
        read window after that: such runs are bounded by ``max_in_transit`` beyond the share. Past
        that bound a run the pool has room for *moves*: it holds its blocks only until its copy is
        written (the next engine step or so), as vLLM holds a finished request's blocks for a send,
        unbounded, but it is hidden until then (a continuation arriving meanwhile pulls an older
        copy, or recomputes). So a run overflows while the bound allows, and moves past it."""
        if self._host is None:
            return False
        kept_after = len(self._kept) + sum(1 for b in ids if b not in self._kept)
        if (
            self._confirmer is not None
            and kept_after <= self.max_pinned + self.max_in_transit
            and self._host.can_take(ids)
        ):
            self._overflow.add(request_id)
            return True
        if self._host.has_room(ids):
            self._moving.add(request_id)
            return True
        return False

    def _give_up_oldest(self, incoming: set[int]) -> None:
        """Give up the oldest runs until retention, with ``incoming`` (a finishing request's blocks)
        added and the given-up runs' blocks gone, is back within ``YIELD_AT`` of its share; only runs
        retained longer ago than ``retention_yield_after_s``."""
        kept = self._kept
        old_enough = time.perf_counter() - self.cfg.retention_yield_after_s

        def projected() -> int:
            return len(kept) + sum(1 for b in incoming if b not in kept)

        held = projected()
        # runs with a host copy first, whatever their age: they stay pullable from the pool
        copied = [rid for rid in self._retained if self._host is not None and self._host.has_copy(rid)]
        for rid in [*copied, *self._retained]:  # then in announce order: oldest first
            if held <= self._yield_above:
                return
            run = self._retained[rid]
            if run.given_up:
                continue
            if run.since > old_enough and not (self._host is not None and self._host.has_copy(rid)):
                return  # this run and every later one were retained too recently
            self._unpin(kept, run.pinned)
            held = projected()
            self._give_up(rid, run)

    def _give_up(self, rid: str, run: _Retained) -> None:
        """Drop a run from the directory now; free its blocks once the drop is confirmed."""
        run.given_up = True
        tm.YIELDED.labels("given_up").inc()
        if run.first_hash is None:  # never announced, never handed out: free it now
            run.settled = True
            self._free_early[rid] = time.perf_counter()
            return
        self._emit(KvloopRetentionReleased(retention_handle=rid, reason="yielded", ts=time.time()))
        assert self._confirmer is not None
        self._confirmer.submit(GivenUp(rid, run.first_hash, run.lora_name))
        tm.log.debug("kvloop.run_given_up", handle=rid, blocks=len(run.pinned))

    @staticmethod
    def _unpin(pins: dict[int, int], blocks: set[int]) -> None:
        for b in blocks:
            if pins[b] == 1:
                del pins[b]
            else:
                pins[b] -= 1

    def take_free_early(self) -> dict[str, float]:
        """Given-up runs whose drop the directory confirmed, and when (perf_counter) the worker may
        free each: for this step's metadata. A run not confirmed in time keeps its lease."""
        # confirmed drops first: a released copy's slots may then serve a run waiting for room
        if self._confirmer is not None:
            for done in self._confirmer.take():
                if done.handle.endswith(HOST_SUFFIX):
                    if self._host is not None:
                        self._host.confirmed(done)
                    continue
                run = self._retained.get(done.handle)
                if run is None:
                    continue
                run.settled = True
                tm.YIELDED.labels("confirmed" if done.free_at is not None else "unconfirmed").inc()
                if done.free_at is not None and done.free_at < run.deadline:
                    run.deadline = done.free_at
                    self._free_early[done.handle] = done.free_at
        if self._host is not None:
            self._host.step()
            self._demote()
            for rid in [r for r in self._moving if not self._host.copying(r)]:
                # copied (or not: no room, failed): nothing here was ever handed out, free it now
                self._moving.discard(rid)
                if rid in self._retained:
                    self._free_early[rid] = time.perf_counter()
            self._settle_overflow()
        free, self._free_early = self._free_early, {}
        return free

    def _settle_overflow(self) -> None:
        """Runs kept past the share until their host copy was made: given up once it is announced
        (the pool now serves them); kept as ordinary runs if no copy came (it failed, or the run's
        lease ended first)."""
        assert self._host is not None
        for rid in list(self._overflow):
            run = self._retained.get(rid)
            if run is None or run.given_up:
                self._overflow.discard(rid)
            elif self._host.has_copy(rid):
                self._overflow.discard(rid)
                self._unpin(self._kept, run.pinned)
                self._give_up(rid, run)
            elif not self._host.copying(rid):
                self._overflow.discard(rid)

    def _demote(self) -> None:
        """Give up the KV-cache blocks of runs whose host copy is older than host_demote_after_s."""
        after = self.cfg.host_demote_after_s
        if after is None or self._host is None or self._confirmer is None:
            return
        now = time.perf_counter()
        for rid, at in list(self._host.announced_at.items()):
            run = self._retained.get(rid)
            if run is not None and not run.given_up and now - at >= after:
                self._unpin(self._kept, run.pinned)
                self._give_up(rid, run)

    def capture_window(self, request_id: str, block_ids: Any, prompt_tokens: int) -> None:
        """A decode request whose prompt KV is arriving from its prefill: have the host tier copy the
        sliding-window blocks that a pull ending at the prompt's last complete block needs, before
        vLLM frees them as the request decodes past its window (host/tier.py). Only complete blocks:
        the last, partly filled one is written on by the tokens the request generates."""
        if self._host is None or not any(self.group_windows):
            return
        bs = self.block_size
        end = prompt_tokens // bs
        picks = []
        for g, (ids, window) in enumerate(zip(block_ids, self.group_windows, strict=False)):
            if not window:
                continue
            for p in range(first_needed_block(end * bs, window, bs), min(end, len(ids))):
                if ids[p] != NULL_BLOCK:
                    picks.append((g, p, ids[p]))
        self._host.capture(request_id, picks)

    def take_host_captures(self) -> dict[str, HostCopy]:
        return self._host.take_captures() if self._host is not None else {}

    def forget_window(self, request_id: str) -> None:
        """The request finished: a capture its run's copy did not take over is given back."""
        if self._host is not None:
            self._host.forget_capture(request_id)

    def host_digested(self, reports: dict[str, dict[int, list[list[int]]]]) -> None:
        if self._host is not None:
            self._host.digests.reported(reports)

    def host_copied(self, done: dict[str, bool]) -> None:
        if self._host is not None:
            self._host.copied(done)

    def take_host_copies(self) -> list[HostCopy]:
        return self._host.take_copies() if self._host is not None else []

    def announce(self, request: Request, out: dict[str, Any], default_ttl_s: float, block_ids: Any) -> None:
        """``out`` is vLLM's returned kv_transfer_params for a finished request it retains;
        ``block_ids`` the request's groups as vLLM handed them over, before it clipped them (see
        :func:`aligned`): all of them stay pinned until vLLM frees the run."""
        bs = self.block_size
        self.check_generation()
        groups = aligned(out["remote_block_ids"], max((len(g) for g in block_ids), default=0))
        n = min([len(request.block_hashes), request.num_computed_tokens // bs] + [len(g) for g in groups])
        rid = request.request_id
        deadline = out.get("remote_blocks_expiry_time") or time.perf_counter() + default_ttl_s
        multi = self.cfg.sharing == "multi"
        pinned = pinned_ids(block_ids)
        run = _Retained(
            deadline=deadline,
            since=time.perf_counter(),
            multi=multi,
            pinned=pinned,
            generation=self.generation,
        )
        self._retained[rid] = run
        for b in pinned:
            self._pins[b] = self._pins.get(b, 0) + 1
            self._kept[b] = self._kept.get(b, 0) + 1
        if multi:
            self.multi_reader_new.add(rid)
        if n <= 0:
            return
        run.first_hash = bytes(request.block_hashes[0])
        run.lora_name = request.lora_request.lora_name if request.lora_request else ""
        lease_ms = max(0, int((deadline - time.perf_counter()) * 1000))
        # The last sampled token never went through the model: KV exists for the tokens before it.
        with_kv = min(request.num_computed_tokens, len(request.all_token_ids) - 1)
        has_tail = n == with_kv // bs and all(len(g) > n and g[n] != NULL_BLOCK for g in groups)
        tail = list(request.all_token_ids[n * bs : with_kv]) if has_tail else []
        event = KvloopBlocksRetained(
            block_hashes=[bytes(h) for h in request.block_hashes[:n]],
            block_ids=[g[:n] for g in groups],
            retention_handle=rid,
            lease_ms=lease_ms,
            single_use=not multi,
            lora_name=request.lora_request.lora_name if request.lora_request else None,
            ts=time.time(),
            tail_token_ids=tail,
            tail_block_ids=[g[n] for g in groups] if tail else [],
            registration_generation=self.generation,
        )
        if rid in self._moving:  # bound for the host pool: announced from there only
            run.given_up = run.settled = True
            run.first_hash = None  # never handed out from here
            self._unpin(self._kept, pinned)
            assert self._host is not None
            self._host.plan(event)
            return
        self._emit(event)
        if self._host is not None and multi:
            self._host.plan(event)
        tm.RETAINED.inc()
        tm.RETAINED_BLOCKS.inc(n)
        tm.log.debug("kvloop.retained", handle=rid, blocks=n, lease_ms=lease_ms, multi=multi)

    def check_generation(self) -> int:
        """Withdraw every announced run retained under an older KV-cache registration generation than
        the engine's current one (vLLM re-registers after a sleep and wake: the runs' block ids name
        memory that was deregistered). The directory also drops them on the first run announced
        under the new generation; this release reaches it without waiting for one. Returns how many."""
        current = self._generation()
        if current <= self.generation:
            return 0
        self.generation = current
        withdrawn = self._withdraw(lambda run: run.generation < current, "reregistered")
        tm.log.warning(
            "kvloop.reregistered",
            generation=current,
            withdrawn=withdrawn,
            detail="the engine registered its KV cache again: runs retained before are withdrawn",
        )
        return withdrawn

    def cache_reset(self) -> None:
        """vLLM resets the connector's cache (before a sleep discards the KV cache, or when asked to
        forget cached KV): every run announced from the KV cache leaves the directory now, before its
        memory goes. Host copies are the pool's, not the KV cache's: it keeps them or releases them
        too, as ``kvloop_host_on_reset`` says."""
        withdrawn = self._withdraw(lambda run: True, "reset")
        self._overflow.clear()
        tm.log.warning(
            "kvloop.kv_cache_reset",
            withdrawn=withdrawn,
            detail="vLLM reset the KV cache: runs retained in it are withdrawn",
        )
        if self._host is not None and self.cfg.host_on_reset == "drop":
            released = self._host.reset()
            tm.log.warning("kvloop.host_pool_reset", released=released)

    def _withdraw(self, which: Callable[[_Retained], bool], reason: str) -> int:
        withdrawn = 0
        for rid, run in self._retained.items():
            if run.given_up or run.first_hash is None or not which(run):
                continue
            run.given_up = run.settled = run.withdrawn = True
            run.first_hash = None  # never handed out from here again
            self._unpin(self._kept, run.pinned)
            self._emit(KvloopRetentionReleased(retention_handle=rid, reason=reason, ts=time.time()))
            withdrawn += 1
        return withdrawn

    def parked_until(self, request_id: str) -> float | None:
        """The lease end of a retained run the engine need not step for until then (see idle.py):
        a multi-reader run, whose READ notices only count reads. None for anything else (a
        single-use run is freed by its READ's notice, which only an engine step picks up)."""
        run = self._retained.get(request_id)
        if run is None or not run.multi or (run.given_up and not run.settled):
            return None  # a run given up steps until its drop is settled (a round trip)
        if self._host is not None and self._host.copying(request_id):
            return None  # its host copy is reported at an engine step
        return min(run.deadline, self._demote_at(request_id, run))

    def _demote_at(self, request_id: str, run: _Retained) -> float:
        """When ``_demote`` gives the run's KV-cache blocks up (at an engine step: an idle engine is
        woken then); infinity when it does not."""
        after = self.cfg.host_demote_after_s
        if after is None or self._host is None or self._confirmer is None or run.given_up:
            return math.inf
        announced = self._host.announced_at.get(request_id)
        return math.inf if announced is None else announced + after

    def shutdown(self) -> None:
        if self._confirmer is not None:
            self._confirmer.stop()

    def released(self, finished_sending: set[str]) -> None:
        now = time.perf_counter()
        for rid in finished_sending:
            run = self._retained.pop(rid, None)
            self._moving.discard(rid)
            self._overflow.discard(rid)
            if self._host is not None:
                self._host.device_released(rid)
            if run is None:
                continue
            self._unpin(self._pins, run.pinned)
            self._free_early.pop(rid, None)
            if run.withdrawn:  # released when the engine registered its KV cache again
                continue
            if run.given_up:  # its release went out when it was given up (if it was ever announced)
                tm.RELEASED.labels(
                    "moved" if run.first_hash is None and self._host is not None else "yielded"
                ).inc()
                continue
            self._unpin(self._kept, run.pinned)
            reason = "expired" if now >= run.deadline - 1.0 else "read"
            tm.RELEASED.labels(reason).inc()
            self._emit(KvloopRetentionReleased(retention_handle=rid, reason=reason, ts=time.time()))
