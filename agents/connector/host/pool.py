"""The decode's host retention pool, worker side: host memory laid out like the KV cache, registered
with NIXL under an engine of its own, that retained runs are copied into.

A prefill reads a run's host copy exactly as it reads a run in a KV cache: through vLLM's NIXL
handshake with the pool's engine (``<engine id>@host``, served on its own side channel by the
scheduler side, host/tier.py), whose metadata is this engine's with the pool's addresses. Every
region of the KV cache has a pool region of ``slots`` blocks of the same length, so a pool slot id
is a block id there, and vLLM's descriptor arithmetic (``_compute_desc_ids``) serves both. Slot 0 is
never handed out: it stands for vLLM's null block. The pool's descriptors are built by the installed
vLLM's own code, in its release's form (compat.py: one row per block, or one strided row per region).

The copy is one NIXL WRITE per run from this engine's agent (the KV cache is registered there) into
the pool's agent, built from vLLM's own descriptors, posted after the step's forward and polled
each step; the scheduler keeps the run's KV-cache blocks until the copy is reported.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlAgentMetadata,
    NixlHandshakePayload,
)
from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config

from kvloop.agents.connector import compat
from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.metadata import HostCopy
from kvloop.common.host_names import HOST_SUFFIX, host_engine_id
from kvloop.common.host_pool_support import PoolLayout, pool_verdict, refusal

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvloop.agents.connector.faults import FaultSwitch
    from kvloop.agents.connector.retained_digests import RetainedDigests
    from kvloop.agents.connector.worker import KvloopConnectorWorker


def bytes_per_block(kv_cache_config: KVCacheConfig) -> int:
    """Bytes one block id holds across every KV-cache tensor (what a pool slot holds)."""
    return sum(t.size for t in kv_cache_config.kv_cache_tensors) // max(1, kv_cache_config.num_blocks)


def pool_slots(kv_cache_config: KVCacheConfig, gib: float) -> int:
    """Usable slots of a ``gib`` pool (slot 0, the null block, comes on top); the scheduler side and
    every worker compute the same."""
    per_block = bytes_per_block(kv_cache_config)
    return max(0, int(gib * 2**30) // per_block - 1) if per_block else 0


# How long a request waits for its window capture before it decodes without one (a WRITE that hangs
# must not hang the request).
CAPTURE_WAIT_S = 5.0


class HeldRequests:
    """Requests held back from vLLM while their window capture is written (see
    :meth:`HostPool.hold_for_captures`)."""

    def __init__(self, wait_s: float = CAPTURE_WAIT_S) -> None:
        self.wait_s = wait_s
        self.requests: dict[str, tuple[str, float]] = {}  # request id -> (capture handle, held since)

    def hold(self, request_id: str, handle: str, now: float) -> None:
        self.requests[request_id] = (handle, now)

    def release(self, writing: Collection[str], now: float) -> tuple[set[str], list[str]]:
        """The requests to let go: those whose capture is no longer being written, and those held
        ``wait_s`` or longer (their captures' handles, second, are to be abandoned)."""
        released, overdue = set(), []
        for request_id, (handle, since) in list(self.requests.items()):
            if handle in writing and now - since < self.wait_s:
                continue
            del self.requests[request_id]
            released.add(request_id)
            if handle in writing:
                overdue.append(handle)
        return released, overdue


class UnsupportedLayout(ValueError):
    """A KV-cache layout the host pool does not mirror (the engine then refuses to start)."""


class HostPool:
    """The pool's memory, its NIXL agent and the copies into it (one per worker rank)."""

    def __init__(
        self,
        worker: KvloopConnectorWorker,
        slots: int,
        digests: RetainedDigests | None = None,
        faults: FaultSwitch | None = None,
    ) -> None:
        self._check(worker)
        self.worker = worker
        # the source blocks' digests each copy's slots are announced with, and the slot fault hook
        self._digests = digests
        self._faults = faults
        self.slots = slots  # usable; ids 1..slots
        rows = slots + 1
        self.engine_id = host_engine_id(worker.engine_id)
        block_lens = list(worker.block_len_per_layer)
        # Host memory, pinned where a GPU would copy into it; one dense buffer per KV-cache region.
        pin = torch.cuda.is_available()
        self._buffers = [torch.zeros(rows * n, dtype=torch.uint8, pin_memory=pin) for n in block_lens]
        bases = [int(b.data_ptr()) for b in self._buffers]
        config = nixl_agent_config(num_threads=1, capture_telemetry=False) if nixl_agent_config else None
        self.agent = NixlWrapper(f"{self.engine_id}-{uuid.uuid4()}", config)
        self._reg = self.agent.get_reg_descs(
            [(base, rows * n, 0, "") for base, n in zip(bases, block_lens, strict=True)], "DRAM"
        )
        self.agent.register_memory(self._reg, backends=worker.nixl_backends)
        # The engine's own agent writes into the pool's.
        self._pool_agent_name = worker.nixl_wrapper.add_remote_agent(self.agent.get_agent_metadata())
        # Region order and descriptor form as vLLM's own for its KV cache (``_build_fa_local``).
        order = worker._transfer_layer_region_indices or range(len(bases))
        self.pool_descs = compat.region_descs(worker, [(bases[i], block_lens[i], rows) for i in order], 0)
        self._dst = compat.prep_region_dlist(
            worker.nixl_wrapper, self._pool_agent_name, self.pool_descs, "DRAM"
        )
        self.region_num_blocks = [rows] * len(worker.region_num_blocks or bases)
        self.handshake = self._handshake_payload(bases, rows)
        self._copies: dict[str, int] = {}  # handle -> NIXL transfer handle
        self._done: dict[str, bool] = {}
        # Each copy's digests (its source blocks', slot_digests.py) and slots, until it is reported.
        self._copy_digests: dict[str, list[list[int]]] = {}
        self._copy_slots: dict[str, list[list[int]]] = {}
        self._digests_done: dict[str, list[list[int]]] = {}
        # Window captures (host/tier.py) by request id, posted when the request's prompt KV has
        # arrived; the requests whose capture is being written, held back from vLLM until it is.
        self._captures: dict[str, HostCopy] = {}
        self._held = HeldRequests()
        # Captures whose request was let go before their WRITE ended: failed, whatever NIXL says.
        self._abandoned: set[str] = set()
        tm.log.info(
            "kvloop.host_pool_registered",
            engine_id=self.engine_id,
            slots=slots,
            bytes=sum(b.numel() for b in self._buffers),
        )

    @staticmethod
    def _check(worker: KvloopConnectorWorker) -> None:
        layout = PoolLayout(
            pipeline_parallel_size=worker.vllm_config.parallel_config.pipeline_parallel_size,
            has_state_space_layers=bool(worker._has_mamba),
            host_staging_buffer=bool(worker.use_host_buffer),
            mixed_memory_types=bool(worker._mixed_mem_types),
            kernel_blocks_per_block=worker._physical_blocks_per_logical_kv_block,
        )
        refused = refusal(pool_verdict(layout))
        if refused is not None:
            raise UnsupportedLayout(refused)

    def _handshake_payload(self, bases: list[int], rows: int) -> NixlHandshakePayload:
        """This engine's handshake metadata, as the pool's engine: its agent, addresses and size."""
        own = self.worker.xfer_handshake_metadata
        assert isinstance(own, NixlHandshakePayload)
        meta = msgspec.msgpack.decode(own.agent_metadata_bytes, type=NixlAgentMetadata)
        pool = dataclasses.replace(
            meta,
            engine_id=self.engine_id,
            agent_metadata=self.agent.get_agent_metadata(),
            kv_caches_base_addr=bases,
            device_id=0,
            num_blocks=rows,
            block_strides=list(meta.block_lens),
            region_num_blocks=list(self.region_num_blocks),
            region_mem_types=["DRAM"] * len(meta.region_mem_types or bases),
        )
        return NixlHandshakePayload(
            compatibility_hash=own.compatibility_hash,
            agent_metadata_bytes=msgspec.msgpack.Encoder().encode(pool),
        )

    def _desc_ids(self, groups: list[list[int]], num_blocks: int, region_num_blocks: list[int]) -> Any:
        w = self.worker
        return w._compute_desc_ids(
            block_ids=groups,
            dst_num_blocks=num_blocks,
            block_size_ratio=None,
            physical_blocks_per_logical=1,
            region_num_blocks=region_num_blocks,
            region_group_ids=w.region_group_ids or None,
            uses_region_group_mapping=w._uses_region_group_mapping,
        )

    def start(self, copy: HostCopy) -> None:
        """Post the WRITE of a run's blocks into its slots."""
        w = self.worker
        try:
            # before the WRITE: what the slots are meant to hold
            digests = self._digests.of_copy(copy) if self._digests is not None else None
            src = self._desc_ids(copy.block_ids, w.num_blocks, list(w.region_num_blocks))
            dst = self._desc_ids(copy.slots, self.slots + 1, self.region_num_blocks)
            assert len(src) == len(dst)
            handle = w.nixl_wrapper.make_prepped_xfer(
                "WRITE", w.src_xfer_handles_by_block_size[w.block_size], src, self._dst, dst
            )
            w.nixl_wrapper.transfer(handle)
        except Exception as exc:  # the run keeps its KV-cache blocks; no host copy is announced
            tm.log.warning("kvloop.host_copy_failed", handle=copy.handle, error=repr(exc))
            self._done[copy.handle] = False
            return
        self._copies[copy.handle] = handle
        if digests is not None:
            self._copy_digests[copy.handle] = digests
            self._copy_slots[copy.handle] = copy.slots

    def expect_captures(self, captures: dict[str, HostCopy]) -> None:
        self._captures.update(captures)

    def hold_for_captures(self, finished: set[str], failed: set[str]) -> set[str]:
        """The requests whose prompt KV has arrived (``finished``, vLLM's finished_recving) that vLLM
        may be told of now. A request with a window capture is held back while its capture is being
        written: until vLLM hears the KV arrived, the request does not decode, so the blocks being
        copied cannot be freed and reused under the copy."""
        for req_id in finished & self._captures.keys():
            copy = self._captures.pop(req_id)
            if req_id in failed:  # no KV to keep
                self._done[copy.handle] = False
                continue
            self.start(copy)
            self._held.hold(req_id, copy.handle, time.monotonic())
        if not self._held.requests:
            return finished
        self._poll_copies()
        released, overdue = self._held.release(self._copies.keys(), time.monotonic())
        for handle in overdue:
            # The request decodes now, so the blocks being copied may be reused under the WRITE: the
            # capture is reported failed once the WRITE ends (its slots come free only then).
            self._abandoned.add(handle)
            tm.HOST_COPIES.labels("window_abandoned").inc()
            tm.log.warning("kvloop.window_capture_abandoned", handle=handle, after_s=CAPTURE_WAIT_S)
        return (finished - self._held.requests.keys()) | released

    def poll(self) -> None:
        """Collect finished copies; drain the pool agent's READ notices (prefills reading copies)."""
        self._poll_copies()
        for notices in self.agent.get_new_notifs().values():
            tm.HOST_READS.inc(len(notices))

    def _poll_copies(self) -> None:
        wrapper = self.worker.nixl_wrapper
        for run, handle in list(self._copies.items()):
            state = wrapper.check_xfer_state(handle)
            if state == "PROC":
                continue
            del self._copies[run]
            if state == "DONE":
                _record_copy(wrapper, handle)
            wrapper.release_xfer_handle(handle)
            self._done[run] = state == "DONE" and run not in self._abandoned
            self._abandoned.discard(run)
            digests, slots = self._copy_digests.pop(run, None), self._copy_slots.pop(run, None)
            if self._done[run] and digests is not None and slots is not None:
                self._digests_done[run] = digests
                self._fault_corrupt(run, slots)
            if state != "DONE":
                tm.log.warning("kvloop.host_copy_failed", handle=run, state=state)

    def drain(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for the copies in flight to end (the KV cache they read is about to
        be deregistered); any still running then is reported failed, so never announced."""
        deadline = time.monotonic() + wait_s
        self._poll_copies()
        while self._copies and time.monotonic() < deadline:
            time.sleep(0.001)  # NIXL has no blocking wait on a transfer: poll its state
            self._poll_copies()
        for run in list(self._copies):
            self._abandoned.add(run)
            tm.log.warning("kvloop.host_copy_abandoned", handle=run, after_s=wait_s)
        self._captures.clear()
        self._held.requests.clear()

    def copying_runs(self) -> set[str]:
        """Device handles of the runs whose copy is in flight."""
        return {handle.removesuffix(HOST_SUFFIX) for handle in self._copies}

    def take_done(self) -> dict[str, bool]:
        done, self._done = self._done, {}
        return done

    def take_digests(self) -> dict[str, list[list[int]]]:
        """The digests of each copy made since the last call, aligned with its slots."""
        digests, self._digests_done = self._digests_done, {}
        return digests

    def _fault_corrupt(self, handle: str, slots: list[list[int]]) -> None:
        """Fault injection (``kvloop_fault_corrupt_host``): overwrite a byte of the copy's last slot
        once the copy is made, as a slot reused too early would."""
        written = [s for g in slots for s in g]
        if not written or self._faults is None or not self._faults.fires("host"):
            return
        slot = written[-1]
        n = self.worker.block_len_per_layer[0]
        self._buffers[0].view(-1, n)[slot, 0] ^= 0xFF
        tm.log.warning("kvloop.fault_corrupted_slot", handle=handle, slot=slot)

    def read_slots(self, slots: list[int]) -> list[torch.Tensor]:
        """The pool's bytes of ``slots`` per region (tests compare them with the KV cache's)."""
        lens = self.worker.block_len_per_layer
        return [buf.view(-1, n)[slots].clone() for buf, n in zip(self._buffers, lens, strict=True)]

    def shutdown(self) -> None:
        try:
            self.agent.deregister_memory(self._reg)
        except Exception as exc:  # shutting down: the process's memory goes anyway
            tm.log.debug("kvloop.host_pool_deregister_failed", error=repr(exc))


def _record_copy(wrapper: Any, handle: Any) -> None:
    """The WRITE's bytes and duration as NIXL measured them (its transfer telemetry, which vLLM turns
    on for its agent); nothing where this NIXL keeps none."""
    try:
        telemetry = wrapper.get_xfer_telemetry(handle)
    except Exception:  # a NIXL without telemetry, or with it off, raises errors of its own kinds
        return
    if telemetry is None:
        return
    tm.HOST_COPIED_BYTES.inc(telemetry.totalBytes)
    tm.HOST_COPY_SECONDS.observe(telemetry.xferDuration / 1e6)
