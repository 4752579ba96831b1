"""The decode's host retention tier, scheduler side: which retained runs get a copy in the host pool
(host/pool.py), where, and for how long; their announcements and their fenced release.

When a retained run is announced, its KV-cache blocks are copied into free pool slots. The pool holds a
block once (common/held_blocks.py: by chained hash, within a LoRA and a KV-cache group): a block an
announced copy holds already is not written again, the new copy names that slot, and a slot comes
free only once no copy names it. Two conversations on one system prompt hold it once, as vLLM's own
KV cache and ``kvloop bench replay``'s pools do. Once the worker reports the copy, the copy is
announced as a run of its own: handle ``<request id>@host``, tier ``host``, slot ids for block ids, its
own lease
(``kvloop_host_retention_ttl_s``). The directory then knows both; the run's KV-cache blocks may go
(decode.py gives up runs with a host copy first) while the copy stays pullable.

A copy's slots are reused only when no prefill can still READ them: a copy released before its lease
ends (the pool needed room, or a later turn's copy holds the same prefix) is dropped from the
directory first, and its slots come free once kvloopd confirms the drop and its read window has passed
(the fence of yielding.py); an expired copy's slots come free after the READ margin, since the
directory never hands out a run that close to its lease's end. Each turn of a conversation makes a
newer copy and supersedes its older one. Which copies go first when the pool needs room is the
eviction policy's call (host/eviction.py, ``kvloop_host_eviction``): by default the oldest copy, the
conversation least recently active.

A run never waits behind its own pool's bookkeeping: when no slots are free, the pool releases copies
for it at once, and the run waits for their slots (the read window of the fence) in the order runs
came, while its KV-cache blocks stay (decode.py keeps it announced from there meanwhile). Only a run
that even every announced and released copy's slots could not hold is left out (``no_room``).

On a hybrid model a decode frees a sliding-window group's blocks as it generates past them, so by
the time a run finishes it holds only the window at its end: a next prompt that agrees with it only
through the previous prompt (a re-rendered or dropped answer) could not be pulled. So when a request's
prompt KV has arrived from its prefill, and before it decodes, the sliding-window blocks a pull ending
at the prompt's last complete block needs are copied into slots of their own (a *window capture*,
``<request id>@window``); the run's copy then holds them beside its own blocks. Every later copy
that shares a prefix with it names those windows too (and the one the earlier run ended with, within
the prefix), and a later turn's copy that supersedes it keeps them: the earlier prompt stays pullable,
for a regenerated answer, a new conversation sharing it, or another continuation of that turn, as
long as any copy of that prefix stays. A slot several copies name comes free only once none of them
can be read.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.events import KvloopBlocksRetained, KvloopRetentionReleased
from kvloop.agents.connector.host.eviction import LRU, eviction_policy, room_wanted
from kvloop.agents.connector.host.slot_digests import SlotDigests
from kvloop.agents.connector.metadata import HostCopy
from kvloop.agents.connector.yielding import Confirmed, GivenUp, ReleaseConfirmer
from kvloop.common.held_blocks import HeldBlocks
from kvloop.common.host_names import HOST_SUFFIX, WINDOW_SUFFIX
from kvloop.common.sliding_window import NULL_BLOCK
from kvloop.common.tokens import agreeing_prefix_length

# A slot's key in the pool's HeldBlocks: (LoRA, chained hash, KV-cache group) for a full block held
# by content; (None, slot id) for a slot no other copy may name by content (a tail block, a full
# block written while another copy was still writing the same content).
SlotKey = tuple[object, ...]


@dataclass
class _Copy:
    event: KvloopBlocksRetained  # the host run's announcement, slot ids for block ids
    deadline: float = 0.0  # perf_counter; set once announced
    state: str = "copying"  # copying | announced | released
    free_at: float | None = None  # released: when its slots may be reused (perf_counter)
    hashes: tuple[bytes, ...] = field(default=())
    discard: bool = False  # being written when the pool was reset: never announced


@dataclass
class _Waiting:
    """A run bound for the pool, waiting for released copies' slots to come free."""

    device: KvloopBlocksRetained
    captured: dict[tuple[int, int], int]  # its window capture's slots, reserved for it


@dataclass
class _Capture:
    slot_at: dict[tuple[int, int], int]  # (group, position) -> slot
    state: str = "copying"  # copying | done | orphaned (its run went: slots free once the copy ends)


class HostTier:
    def __init__(
        self,
        slots: int,
        ttl_s: float,
        read_margin_s: float,
        emit: Callable[[Any], None],
        confirmer: ReleaseConfirmer | None,
        eviction: str = LRU,
        ranks: int = 1,
    ) -> None:
        self.slots = slots
        # what each slot holds, as digests: a host run is announced with its slots' (slot_digests.py)
        self.digests = SlotDigests(ranks)
        self.ttl_s = ttl_s
        self.read_margin_s = read_margin_s
        self._emit = emit
        self._confirmer = confirmer
        self._free = list(range(slots, 0, -1))  # pop() hands out the lowest first
        self._copies: OrderedDict[str, _Copy] = OrderedDict()  # host handle -> copy, oldest first
        self._pending: list[HostCopy] = []
        self._waiting: OrderedDict[str, _Waiting] = OrderedDict()  # host handle -> run waiting for room
        self.announced_at: dict[str, float] = {}  # device handle -> when its copy was announced
        self._captures: dict[str, _Capture] = {}  # device handle -> its window capture
        self._pending_captures: dict[str, HostCopy] = {}  # request id -> capture for the worker
        # The slots copies name, by key: a slot comes free once no copy names it (and the fence of the
        # last that did has passed). Content keys of announced copies are readable: a later copy names
        # their slots instead of writing the same blocks again.
        self._blocks: HeldBlocks[SlotKey] = HeldBlocks()
        self._slot_of: dict[SlotKey, int] = {}
        self._key_at: dict[int, SlotKey] = {}
        self._readable: set[SlotKey] = set()
        # The copies not released yet, in the order the pool gives them up; a copy's turn ended when
        # its run was retained (plan).
        self.eviction = eviction_policy(eviction, ttl_s)

    @staticmethod
    def handle_of(device_handle: str) -> str:
        return device_handle + HOST_SUFFIX

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def has_room(self, block_ids: set[int]) -> bool:
        """Whether a run holding ``block_ids`` would get slots now (no run waits for room before it)."""
        return not self._waiting and len(block_ids) <= self.free_slots

    def has_copy(self, device_handle: str) -> bool:
        return device_handle in self.announced_at

    def copying(self, device_handle: str) -> bool:
        """Whether a run's copy is waiting for room or being written (its blocks must stay)."""
        handle = self.handle_of(device_handle)
        copy = self._copies.get(handle)
        return handle in self._waiting or (copy is not None and copy.state == "copying")

    def plan(self, device: KvloopBlocksRetained) -> None:
        """Copy the run ``device`` announces (its KV-cache block ids) into the pool. Without free slots
        now, copies are released to make room; the run waits for their slots (a read window after
        the directory dropped them) unless even all of them could not hold it."""
        handle = self.handle_of(device.retention_handle)
        capture = self._captures.pop(device.retention_handle, None)
        captured = capture.slot_at if capture is not None and capture.state == "done" else {}
        if capture is not None and not captured:
            self._drop_capture(device.retention_handle, capture)
        self.eviction.turn(device.block_hashes, time.perf_counter())
        self._make_room(self._needed(device) + self._waiting_need())
        needed = self._needed(device)
        if not self._waiting and needed <= len(self._free):
            self._place(handle, device, captured)
        elif needed <= self._obtainable():
            self._waiting[handle] = _Waiting(device, captured)
            tm.HOST_COPIES.labels("waiting").inc()
        else:
            tm.HOST_COPIES.labels("no_room").inc()
            self._free.extend(captured.values())

    def _content_key(self, device: KvloopBlocksRetained, group: int, position: int) -> SlotKey | None:
        if position >= len(device.block_hashes):
            return None
        return (device.lora_name or "", device.block_hashes[position], group)

    def _held_slot(self, device: KvloopBlocksRetained, group: int, position: int) -> int | None:
        """The slot of a block at (group, position) an announced copy holds already, if any."""
        key = self._content_key(device, group, position)
        return self._slot_of[key] if key in self._readable else None

    def _to_write(self, device: KvloopBlocksRetained) -> list[list[int]]:
        """Per group, the KV-cache blocks the copy writes: the run's blocks the pool does not hold yet
        and its partly filled tail block."""
        tails = device.tail_block_ids or [NULL_BLOCK] * len(device.block_ids)
        return [
            [
                *(
                    b
                    for p, b in enumerate(ids_g)
                    if b != NULL_BLOCK and self._held_slot(device, g, p) is None
                ),
                *([tail] if tail != NULL_BLOCK else []),
            ]
            for g, (ids_g, tail) in enumerate(zip(device.block_ids, tails, strict=True))
        ]

    def _needed(self, device: KvloopBlocksRetained) -> int:
        """Free slots a run's copy takes: one per distinct block the pool does not hold yet."""
        return len({b for g in self._to_write(device) for b in g})

    def _name(self, handle: str, key: SlotKey | None, slot: int) -> None:
        """Copy ``handle`` names ``slot``: by content where no copy holds that content yet."""
        if slot in self._key_at:
            key = self._key_at[slot]
        elif key is None or key in self._blocks:
            key = (None, slot)
        self._slot_of[key], self._key_at[slot] = slot, key
        self._blocks.hold(handle, [key])

    def _place(self, handle: str, device: KvloopBlocksRetained, captured: dict[tuple[int, int], int]) -> None:
        """Give a run its slots and hand the worker its copy: only the blocks the pool does not hold
        yet are written; the copy names the slots of those it does."""
        copied = self._to_write(device)
        slot_of = {b: self._free.pop() for b in sorted({b for g in copied for b in g})}
        slot_groups: list[list[int]] = []
        shared = 0
        for g, ids_g in enumerate(device.block_ids):
            slots_g = []
            for p, b in enumerate(ids_g):
                held = self._held_slot(device, g, p)
                if held is not None:
                    slot = held
                    shared += 1
                elif b != NULL_BLOCK:
                    slot = slot_of[b]
                else:  # no longer in its KV cache: read from its window capture, if any
                    slot = captured.get((g, p), NULL_BLOCK)
                if slot != NULL_BLOCK:
                    self._name(handle, self._content_key(device, g, p), slot)
                slots_g.append(slot)
            slot_groups.append(slots_g)
        for slot in slot_of.values():  # its tail blocks
            self._name(handle, None, slot)
        named = {s for g in slot_groups for s in g}
        # a capture of a block the pool held already: never announced, so no READ can reach it
        self._free.extend(s for s in captured.values() if s not in named)
        event = KvloopBlocksRetained(
            block_hashes=device.block_hashes,
            block_ids=slot_groups,
            retention_handle=handle,
            lease_ms=int(self.ttl_s * 1000),
            single_use=False,
            lora_name=device.lora_name,
            tail_token_ids=device.tail_token_ids,
            tail_block_ids=[slot_of.get(b, NULL_BLOCK) for b in device.tail_block_ids],
            tier="host",
        )
        self._copies[handle] = _Copy(event, hashes=tuple(device.block_hashes))
        self.eviction.add(handle, device.block_hashes, time.perf_counter())
        if shared:
            tm.HOST_SHARED_BLOCKS.inc(shared)
        if slot_of:
            write = HostCopy(handle, copied, [[slot_of[b] for b in g] for g in copied])
            self.digests.expect(write)
            self._pending.append(write)
        else:  # the pool holds every block already: nothing to write
            self.copied({handle: True})

    def _waiting_need(self) -> int:
        return sum(self._needed(w.device) for w in self._waiting.values())

    def _obtainable(self) -> int:
        """Slots a new run could get once released copies' fences pass and every announced copy is
        given up, beyond what the runs already waiting need."""
        being_written = {
            k for h, c in self._copies.items() if c.state == "copying" for k in self._blocks.names(h)
        }
        return len(self._free) + len(self._blocks) - len(being_written) - self._waiting_need()

    def can_take(self, block_ids: set[int]) -> bool:
        """Whether a run holding ``block_ids`` would get slots, now or once the pool made room."""
        return len(block_ids) <= self._obtainable()

    def _place_waiting(self) -> None:
        """Runs waiting for room, in the order they came: each as soon as its slots are free."""
        while self._waiting:
            handle, waiting = next(iter(self._waiting.items()))
            needed = self._needed(waiting.device)
            if needed > len(self._free):
                self._make_room(self._waiting_need())
                return
            del self._waiting[handle]
            self._place(handle, waiting.device, waiting.captured)
            tm.HOST_COPIES.labels("waited").inc()

    def capture(self, request_id: str, picks: list[tuple[int, int, int]]) -> None:
        """Copy a decoding request's blocks ``picks`` ((group, position, block id), the sliding-window
        blocks its run will have freed by the time it finishes) into slots of their own, if there is
        room; its run's copy takes them over (:meth:`plan`)."""
        if not picks or request_id in self._captures:
            return
        self._make_room(len(picks))
        if len(picks) > len(self._free):
            tm.HOST_COPIES.labels("window_no_room").inc()
            return
        slot_at = {(g, p): self._free.pop() for g, p, _ in picks}
        groups = 1 + max(g for g, _, _ in picks)
        block_ids: list[list[int]] = [[] for _ in range(groups)]
        slots: list[list[int]] = [[] for _ in range(groups)]
        for g, p, block in picks:
            block_ids[g].append(block)
            slots[g].append(slot_at[(g, p)])
        self._captures[request_id] = _Capture(slot_at)
        write = HostCopy(request_id + WINDOW_SUFFIX, block_ids, slots)
        self.digests.expect(write)
        self._pending_captures[request_id] = write

    def take_captures(self) -> dict[str, HostCopy]:
        out, self._pending_captures = self._pending_captures, {}
        return out

    def forget_capture(self, request_id: str) -> None:
        """The request ended without a run copied here: its capture's slots go back (none was ever
        announced, so no READ can reach them; one still being written waits for its copy to end)."""
        never_sent = self._pending_captures.pop(request_id, None) is not None
        capture = self._captures.pop(request_id, None)
        if capture is not None and never_sent:  # the worker never heard of it
            self._free.extend(capture.slot_at.values())
        elif capture is not None:
            self._drop_capture(request_id, capture)

    def _drop_capture(self, request_id: str, capture: _Capture) -> None:
        if capture.state == "copying":
            capture.state = "orphaned"
            self._captures[request_id + WINDOW_SUFFIX] = capture  # freed when its copy is reported
        else:
            self._free.extend(capture.slot_at.values())

    def _captured(self, handle: str, ok: bool) -> None:
        request_id = handle.removesuffix(WINDOW_SUFFIX)
        orphan = self._captures.pop(handle, None)
        if orphan is not None:
            self._free.extend(orphan.slot_at.values())
            return
        capture = self._captures.get(request_id)
        if capture is None or capture.state != "copying":
            return
        tm.HOST_COPIES.labels("window_copied" if ok else "window_failed").inc()
        if ok:
            capture.state = "done"
        else:
            del self._captures[request_id]
            self._free.extend(capture.slot_at.values())

    def take_copies(self) -> list[HostCopy]:
        out, self._pending = self._pending, []
        return out

    def copied(self, done: dict[str, bool]) -> None:
        """The worker's report: announce each copy made; give back the slots of each that failed."""
        now = time.perf_counter()
        for handle, ok in done.items():
            self.digests.done(handle)
            if handle.endswith(WINDOW_SUFFIX):
                self._captured(handle, ok)
                continue
            copy = self._copies.get(handle)
            if copy is None or copy.state != "copying":
                continue
            if not ok or copy.discard:
                tm.HOST_COPIES.labels("failed" if not ok else "discarded").inc()
                del self._copies[handle]
                self.eviction.forget(handle)
                self._give_back(handle)
                continue
            copy.state, copy.deadline = "announced", now + self.ttl_s
            self._hold_by_content(handle, copy)
            superseded = self._superseded_by(handle, copy)
            copy.event.block_digests = self.digests.blob(copy.event)
            self._emit(_with_ts(copy.event))
            for older, old in superseded:
                self._release(older, old, "superseded")
            self.announced_at[handle.removesuffix(HOST_SUFFIX)] = now
            tm.HOST_COPIES.labels("copied").inc()

    def device_released(self, device_handle: str) -> None:
        """vLLM freed a run's KV-cache blocks: a copy still waiting for room can no longer be made."""
        self.announced_at.pop(device_handle, None)
        waiting = self._waiting.pop(self.handle_of(device_handle), None)
        if waiting is not None:
            tm.HOST_COPIES.labels("no_room").inc()
            self._free.extend(waiting.captured.values())

    def confirmed(self, done: Confirmed) -> None:
        """kvloopd's answer for a released copy: its slots come free a read window after the drop was
        confirmed; unconfirmed, when its lease has ended."""
        copy = self._copies.get(done.handle)
        if copy is not None and copy.state == "released":
            copy.free_at = done.free_at if done.free_at is not None else copy.deadline + self.read_margin_s

    def reset(self) -> int:
        """Release every copy (``kvloop_host_on_reset`` "drop"): announced ones are dropped from the
        directory and fenced as on eviction; those still waiting or being written are never announced.
        Returns how many copies were released."""
        released = 0
        for handle, copy in list(self._copies.items()):
            if copy.state == "announced":
                self._release(handle, copy, "reset")
                released += 1
            elif copy.state == "copying":
                copy.discard = True  # its WRITE may still be running: its slots come back when it ends
        for waiting in self._waiting.values():
            self._free.extend(waiting.captured.values())
        released += len(self._waiting)
        self._waiting.clear()
        return released

    def step(self) -> None:
        """Expire copies whose lease ended; give back the slots of released copies past their fence."""
        now = time.perf_counter()
        for handle, copy in list(self._copies.items()):
            if copy.state == "announced" and now >= copy.deadline:
                self._release(handle, copy, "expired", fence=False)
            if copy.state == "released" and copy.free_at is not None and now >= copy.free_at:
                del self._copies[handle]
                self._give_back(handle)
        self._place_waiting()

    def _superseded_by(self, newer: str, copy: _Copy) -> list[tuple[str, _Copy]]:
        """The announced copies whose blocks the newer copy ``newer`` starts with, to release once it
        is announced (it holds them all). First the newer copy takes over, from every announced copy
        it shares a prefix with, the blocks of that prefix it holds none of itself (see
        :meth:`_take_over`): it then serves every pull the copies it supersedes served."""
        out = []
        for handle, old in self._copies.items():
            if handle == newer or old.state != "announced":
                continue
            shared = agreeing_prefix_length(copy.hashes, old.hashes)
            if shared:
                self._take_over(newer, copy, old, shared)
            if shared == len(old.hashes):
                out.append((handle, old))
        return out

    def _take_over(self, handle: str, copy: _Copy, old: _Copy, blocks: int) -> None:
        """``copy`` names ``old``'s slots at the positions of the first ``blocks`` blocks (the prefix
        the two runs share) where it holds none itself.

        On a hybrid model those are sliding-window blocks: an earlier turn's copy holds the window its
        prompt ended with (its window capture) and the one its run ended with, which a later turn's
        run, or another continuation of the same turn, had freed by the time it finished. A
        regenerated answer, a new conversation sharing that prompt, or one more continuation of that
        turn needs exactly those windows, so they stay with every copy of the prefix rather than with
        one copy that may go first. The same chained hashes mean the same tokens up to each position,
        so these are the very blocks ``copy`` lacks. A slot several copies name comes free with the
        last of them, once its fence has passed (:meth:`_give_back`): until then one of them may be
        read."""
        groups = [list(g) for g in copy.event.block_ids]
        for mine, theirs in zip(groups, old.event.block_ids, strict=False):
            for p in range(min(blocks, len(mine), len(theirs))):
                if theirs[p] != NULL_BLOCK and mine[p] == NULL_BLOCK:
                    mine[p] = theirs[p]
                    self._blocks.hold(handle, [self._key_at[theirs[p]]])
        copy.event = msgspec.structs.replace(copy.event, block_ids=groups)

    def _hold_by_content(self, handle: str, copy: _Copy) -> None:
        """An announced copy's full blocks become readable by content: later copies name their slots.
        A block it wrote while another copy was writing the same one is held by content now if that
        other copy's WRITE failed or its slots came free meanwhile."""
        lora = copy.event.lora_name or ""
        for g, slots in enumerate(copy.event.block_ids):
            for p, slot in enumerate(slots[: len(copy.hashes)]):
                content = (lora, copy.hashes[p], g)
                key = self._key_at.get(slot)
                if key is not None and key[0] is None and content not in self._blocks:
                    self._blocks.rekey(key, content)
                    del self._slot_of[key]
                    self._slot_of[content], self._key_at[slot] = slot, content
                    key = content
                if key == content:
                    self._readable.add(content)

    def _give_back(self, handle: str) -> None:
        """A copy's slots, past its fence: free, but for those another copy still names."""
        for key in self._blocks.release(handle):
            slot = self._slot_of.pop(key)
            del self._key_at[slot]
            self._readable.discard(key)
            self._free.append(slot)

    def _make_room(self, needed: int) -> None:
        """Release copies, in the eviction policy's order, while too few slots are free or coming free
        (one still being copied is skipped: it was never announced)."""
        want = room_wanted(self.free_slots, needed, self.slots)
        if not want:
            return
        # the slots that come free once the released copies' fences pass: those no other copy names
        coming = self._blocks.leaving(h for h, c in self._copies.items() if c.state == "released")
        for handle in self.eviction.victims(time.perf_counter()):
            if self.free_slots + coming.blocks >= want:
                return
            copy = self._copies[handle]
            if copy.state == "announced":
                self._release(handle, copy, "evicted")
                coming.add(handle)

    def _release(self, handle: str, copy: _Copy, reason: str, fence: bool = True) -> None:
        copy.state = "released"
        self.eviction.forget(handle)
        self.announced_at.pop(handle.removesuffix(HOST_SUFFIX), None)
        self._emit(KvloopRetentionReleased(retention_handle=handle, reason=reason, ts=time.time()))
        tm.HOST_RELEASED.labels(reason).inc()
        if not fence:  # past its lease: never handed out again, so the READ margin is enough
            copy.free_at = copy.deadline + self.read_margin_s
        elif self._confirmer is not None and copy.hashes:
            self._confirmer.submit(GivenUp(handle, copy.hashes[0], copy.event.lora_name or ""))
        else:
            copy.free_at = copy.deadline + self.read_margin_s


def _with_ts(event: KvloopBlocksRetained) -> KvloopBlocksRetained:
    return msgspec.structs.replace(event, ts=time.time())
