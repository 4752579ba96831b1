"""Worker-side half of the kvloop connector (runs where the KV cache lives), and the one module
that overrides private methods of vLLM's NIXL connector.

Data movement is vLLM's NixlConnector unchanged. kvloop adds:

* the one place a READ starts (``_read_blocks_for_req``): a pull whose holder's lease ends
  within ``kvloop_read_margin_s`` is not read (the holder may free and reuse the blocks);
* multi-reader retention (``_get_new_notifs``): vLLM frees a retained run after the first READ
  notice; for runs the scheduler marked multi-reader the notice is counted and the blocks stay
  until the lease (``decoder_kv_blocks_ttl``) ends, so several prefills can read them.
  Freed runs then go through vLLM's normal ``finished_sending`` path;
* warm peers (prefill role, ``kvloop_warm_peers_s``): NIXL connections to holders are opened when
  kvloopd first lists them (:mod:`.peers`), through vLLM's own handshake machinery
  (``_ensure_handshake``), so no user turn pays the handshake;
* a relaunched holder (prefill role): a holder's new registration epoch means a new engine process
  behind the same engine id and side-channel port. vLLM would keep the dead process's NIXL agent
  for good (NIXL keeps its metadata after failed READs, measured), so when the peer warmer or a pull
  brings a new epoch the old agent is released (at once when nothing reads from it, else through
  vLLM's invalid-peer path) and the new process handshaken. Each pull carries its run's holder epoch;
  a run of an epoch seen replaced is never read (``_holder_epoch_veto``);
* verified pulls: a retained run's blocks are digested at the step after it is retained (decode
  role, ``start_load_kv``), and a pull's READ is checked against the holder's digests before vLLM
  hears the KV arrived (prefill role, ``_pop_done_transfers``; read_check.py): a mismatch fails the
  pull as a failed READ does, so vLLM recomputes;
* the NIXL progress-thread fix: NIXL's Python API hard-codes the progress thread's delay to 0
  (a full core busy-spinning per agent); we give it ``kvloop_nixl_progress_delay_us``.

These overrides mirror the private code of the vLLM releases in
:data:`kvloop.common.vllm_compat.SUPPORTED_VLLM` (``make vllm-compat`` checks each release's source):
importing this module with another vLLM fails with one line naming that range.
"""

from __future__ import annotations

import queue
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

from kvloop.agents.connector import compat
from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.config import KvloopConfig
from kvloop.agents.connector.digest import BlockDigester
from kvloop.agents.connector.faults import FaultSwitch
from kvloop.agents.connector.host.pool import CAPTURE_WAIT_S, HostPool, pool_slots
from kvloop.agents.connector.metadata import (
    VERIFY_FAILED,
    KvloopConnectorMetadata,
    KvloopWorkerMetadata,
    ReadTiming,
)
from kvloop.agents.connector.peers import Peer, PeerWarmer
from kvloop.agents.connector.read_check import Pairs, ReadChecks
from kvloop.agents.connector.retained_digests import RetainedDigests
from kvloop.common.vllm_compat import SUPPORTED_VLLM as SUPPORTED_VLLM
from kvloop.common.vllm_compat import check_supported

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig


def check_vllm_version(installed: str | None = None) -> None:
    """Refuse (ImportError, one line naming the supported range) a vLLM this module was not checked
    against: its overrides mirror private code of the releases in ``SUPPORTED_VLLM``."""
    import vllm

    check_supported(installed or vllm.__version__)


check_vllm_version()

_PATCHED_DELAY: list[int] = []


def apply_nixl_progress_delay(delay_us: int) -> bool:
    """Make NIXL agents created from now on use a progress-thread delay of ``delay_us``."""
    if _PATCHED_DELAY:
        _PATCHED_DELAY[0] = delay_us
        return True
    try:
        import nixl._api as api  # resolves to nixl_cu12._api / nixl_cu13._api at runtime
    except Exception:
        return False
    bind = getattr(api, "nixlBind", None)
    if bind is None or not hasattr(bind, "nixlAgent"):
        return False
    real_agent = bind.nixlAgent

    def agent_with_delay(name: str, cfg: Any, *a: Any, **kw: Any) -> Any:
        try:
            if cfg.useProgThread:
                cfg.pthrDelay = _PATCHED_DELAY[0]
        except Exception:
            pass
        return real_agent(name, cfg, *a, **kw)

    class _BindProxy:
        def __getattr__(self, item: str) -> Any:
            return getattr(bind, item)

    proxy = _BindProxy()
    proxy.nixlAgent = agent_with_delay  # type: ignore[attr-defined]
    api.nixlBind = proxy
    _PATCHED_DELAY.append(delay_us)
    return True


class KvloopConnectorWorker(NixlPullConnectorWorker):
    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig,
        cfg: KvloopConfig,
    ) -> None:
        self.cfg = cfg
        if cfg.nixl_progress_delay_us is not None:
            apply_nixl_progress_delay(cfg.nixl_progress_delay_us)
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._multi_reader: set[str] = set()
        self.kvloop_reads: Counter[str] = Counter()
        # Engine steps this worker saw (vLLM asks for transfer results once per step, idle or not).
        self.kvloop_steps = 0
        # Prefill role: local perf_counter deadline of each pending kvloop pull.
        self._pull_deadlines: dict[str, float] = {}
        # Prefill role: NIXL's timing of each finished READ, for the scheduler (take_worker_meta).
        self._read_timings: dict[str, ReadTiming] = {}
        # Prefill role: pulls whose READ had to wait for a handshake with its holder (no warm peer).
        self._handshake_reads: set[str] = set()
        # Prefill role: the holder epoch each pending pull's run was announced under ...
        self._pull_holder_epochs: dict[str, int] = {}
        # ... the registration epoch last seen for each holder engine (the process its NIXL agent
        # reaches), and the epochs it had before (processes that ended: their runs are never read).
        self._peer_epochs: dict[str, int] = {}
        self._retired_epochs: dict[str, set[int]] = {}
        # ... and the highest KV-cache registration generation a pull carried for each holder engine
        # (vLLM >= 0.33; a holder that slept and woke registered its memory again).
        self._peer_generations: dict[str, int] = {}
        # Holders registered under a new epoch (warmer thread -> this thread), and those whose old
        # NIXL agent is not released yet (their reads decline until it is).
        self._restarted_peers: queue.SimpleQueue[Peer] = queue.SimpleQueue()
        self._replaced_peers: dict[str, Peer] = {}
        self._warmer: PeerWarmer | None = None
        # Decode role: the host retention pool (host/pool.py), once the KV cache is registered.
        self._host_slots = (
            pool_slots(kv_cache_config, cfg.host_retention_gib) if cfg.host_retention_gib else 0
        )
        self.host_pool: HostPool | None = None
        # Digests of this worker's blocks (once the KV cache is registered): retained runs' (decode
        # role, reported to the scheduler) and pulled blocks' (prefill role, checked in read_checks).
        self.digester: BlockDigester | None = None
        self.read_checks = ReadChecks()
        # Fault injection (faults.py): never on unless configured.
        self.faults = FaultSwitch(cfg.fault_corrupt_retained, cfg.fault_corrupt_host, cfg.fault_file)
        self.retained_digests = RetainedDigests(self.faults)

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        if isinstance(kv_caches, dict):
            self.digester = self.retained_digests.digester = BlockDigester(kv_caches, self.kv_cache_config)
        if self._host_slots and self._bidirectional_kv_xfer_enabled:
            self.host_pool = HostPool(self, self._host_slots, self.retained_digests, self.faults)
        # A handshake sends this engine's registered memory: start warming peers once it is registered.
        cfg = self.cfg
        if cfg.daemon and cfg.lookup and cfg.warm_peers_s and self._bidirectional_kv_xfer_enabled:
            self._warmer = PeerWarmer(
                cfg.daemon,
                cfg.worker_id or self.engine_id,
                self.engine_id,
                cfg.model,
                self._warm_peer,
                cfg.warm_peers_s,
                restarted=self._peer_restarted,
            ).start()

    def _warm_peer(self, peer: Peer) -> None:
        """Open the NIXL connection to ``peer`` in vLLM's handshake thread (as a first READ would)."""
        started = time.perf_counter()
        self._peer_epochs.setdefault(peer.engine_id, peer.epoch)
        future = self._ensure_handshake(peer.engine_id, peer.host, peer.port, peer.tp_size)
        if future is None:
            return  # already connected (a READ got there first)

        def done(f: Any) -> None:
            ms = round((time.perf_counter() - started) * 1e3, 1)
            if f.exception() is None:
                tm.log.info(
                    "kvloop.peer_warmed", peer=peer.worker_id, engine_id=peer.engine_id, handshake_ms=ms
                )
                return
            tm.log.warning("kvloop.warm_peer_failed", peer=peer.worker_id, error=repr(f.exception()))
            if self._warmer is not None:
                self._warmer.warmed.pop(peer.engine_id, None)  # try again next poll

        future.add_done_callback(done)

    def _peer_restarted(self, peer: Peer) -> None:
        """(Warmer thread.) ``peer`` is registered under a new epoch: handled on the worker's thread."""
        self._restarted_peers.put(peer)

    def _holder_replaced(self, engine_id: str, epoch: int, peer: Peer | None = None) -> bool:
        """A new process (registration ``epoch``) serves ``engine_id``: the old epoch's runs are never
        read again, and the old process's NIXL agent goes - now when nothing reads from it (True),
        else through vLLM's invalid-peer path once its reads drain (False: reads decline meanwhile).
        ``peer``: handshake the new process once the old agent is gone (a pull handshakes itself)."""
        old = self._peer_epochs.get(engine_id)
        if old == epoch:
            return engine_id not in self._replaced_peers
        if old is not None:
            self._retired_epochs.setdefault(engine_id, set()).add(old)
        self._peer_epochs[engine_id] = epoch
        tm.log.warning("kvloop.holder_replaced", engine_id=engine_id, old_epoch=old, epoch=epoch)
        if engine_id not in self._remote_agents:
            self._replaced_peers.pop(engine_id, None)
            if peer is not None:
                self._warm_peer(peer)
            return True
        # vLLM defers releases while a handshake may be loading native metadata; so do we.
        if not self._handshake_futures and engine_id not in self._engines_with_inflight_transfers():
            self._cleanup_remote_engine(engine_id, log_eviction=False)
            self._replaced_peers.pop(engine_id, None)
            tm.log.info("kvloop.holder_agent_released", engine_id=engine_id, epoch=epoch)
            if peer is not None:
                self._warm_peer(peer)
            return True
        if engine_id not in self._invalid_remote_engines:
            self._mark_remote_engine_invalid(engine_id, time.perf_counter())
        if peer is not None:
            self._replaced_peers[engine_id] = peer
        return False

    def _take_restarted_peers(self) -> None:
        while True:
            try:
                peer = self._restarted_peers.get_nowait()
            except queue.Empty:
                return
            self._holder_replaced(peer.engine_id, peer.epoch, peer)

    def _cleanup_remote_engines(self) -> None:
        """vLLM's release of replaced and invalid peers (once per step), with restarted holders
        marked invalid first; a released one is handshaken again, reaching its new process."""
        self._take_restarted_peers()
        super()._cleanup_remote_engines()
        for engine_id, peer in list(self._replaced_peers.items()):
            if engine_id not in self._remote_agents and engine_id not in self._handshake_futures:
                del self._replaced_peers[engine_id]
                tm.log.info("kvloop.holder_agent_released", engine_id=engine_id, epoch=peer.epoch)
                self._warm_peer(peer)

    def _generation_veto(self, engine_id: str, generation: int) -> str | None:
        """Why a run retained under registration ``generation`` must not be read from ``engine_id``:
        the holder registered its KV cache again since (vLLM 0.33's sleep and wake), so the run's
        block ids name memory that was deregistered. vLLM loads the holder's new registration when a
        pull brings a higher generation; it would read an older generation's run against it."""
        seen = self._peer_generations.get(engine_id, 0)
        if generation < seen:
            return f"the run was retained under registration generation {generation}; the holder is at {seen}"
        self._peer_generations[engine_id] = generation
        return None

    def _holder_epoch_veto(self, req_id: str, engine_id: str) -> str | None:
        """Why the pull's run must not be read from ``engine_id`` as this worker reaches it now, or None.

        A run's block ids are only meaningful in the process that announced it, known by the holder's
        registration epoch (a new agent epoch = a new engine process). The epoch last seen for the
        holder (from the warmer, or from a newer pull) is the process the cached NIXL agent reaches, or
        the next handshake will."""
        self._take_restarted_peers()
        run_epoch = self._pull_holder_epochs.get(req_id)
        if run_epoch is None:
            return None
        if run_epoch in self._retired_epochs.get(engine_id, ()):
            return "the run's holder process ended"
        current = self._peer_epochs.get(engine_id)
        if current is None:
            self._peer_epochs[engine_id] = run_epoch
        elif current != run_epoch and not self._holder_replaced(engine_id, run_epoch):
            return "the holder was relaunched; its old NIXL agent is released once its reads drain"
        if engine_id in self._invalid_remote_engines and engine_id in self._remote_agents:
            return "the holder's old NIXL agent is not released yet"
        return None

    def unregister_kv_caches(self) -> None:
        """vLLM >= 0.33, before a sleep discards the KV cache: the host pool's copies out of it end
        first (the pool itself stays registered and served: it is host memory)."""
        if self.host_pool is not None:
            self.host_pool.drain(CAPTURE_WAIT_S)
        super().unregister_kv_caches()  # type: ignore[misc]

    def shutdown(self) -> None:
        if self._warmer is not None:
            self._warmer.stop()
        super().shutdown()
        if self.host_pool is not None:
            self.host_pool.shutdown()

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        if isinstance(metadata, KvloopConnectorMetadata):
            self._multi_reader |= metadata.multi_reader
            now = time.perf_counter()
            sched_clock = metadata.scheduler_clock or now
            for req_id, dl in metadata.pull_deadlines.items():
                # rebase from the scheduler's clock onto ours (as vLLM does for reqs_to_send)
                self._pull_deadlines[req_id] = now + (dl - sched_clock)
            self._pull_holder_epochs.update(metadata.pull_holder_epochs)
            self.read_checks.expect(metadata.pull_checks)
            for handle, ask in metadata.digest_runs.items():
                self.retained_digests.run(handle, ask)
        super().start_load_kv(metadata)
        if isinstance(metadata, KvloopConnectorMetadata) and metadata.free_early:
            self._bring_leases_forward(metadata.free_early, metadata.scheduler_clock)
        if isinstance(metadata, KvloopConnectorMetadata) and self.host_pool:
            for copy in metadata.host_copies:
                self.host_pool.start(copy)
            self.host_pool.expect_captures(metadata.host_captures)

    def _bring_leases_forward(self, free_at: dict[str, float], sched_clock: float | None) -> None:
        """Given-up runs (decode role) end their lease at ``free_at`` (scheduler clock) instead:
        vLLM's lease reaping frees them then. A lease only ever moves earlier here."""
        now = time.perf_counter()
        for req_id, at in free_at.items():
            held = self._reqs_to_send.get(req_id)
            if held is not None:
                self._reqs_to_send[req_id] = min(held, now + (at - (sched_clock or now)))

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        declined = None if meta.remote is None else self._holder_epoch_veto(req_id, meta.remote.engine_id)
        event = "kvloop.read_declined_holder_restarted"
        if declined is None and meta.remote is not None:
            declined = self._generation_veto(meta.remote.engine_id, compat.remote_generation(meta.remote))
            event = "kvloop.read_declined_reregistered"
        if declined is not None:
            # Never READ a dead process's run from its successor, nor a run from memory the holder
            # registered again since: wrong KV, and no error anywhere.
            tm.log.warning(
                event,
                request_id=req_id,
                engine_id=meta.remote.engine_id,
                run_epoch=self._pull_holder_epochs.get(req_id),
                holder_epoch=self._peer_epochs.get(meta.remote.engine_id),
                reason=declined,
            )
            self._pull_deadlines.pop(req_id, None)
            self._pull_holder_epochs.pop(req_id, None)
            self.read_checks.forget(req_id)
            self._handle_failed_transfer(req_id, None, self._recv_failures, record_failed_transfer=False)
            return
        deadline = self._pull_deadlines.get(req_id)
        if deadline is not None:
            if time.perf_counter() + self.cfg.read_margin_s >= deadline:
                # The holder may free (and reuse) these blocks before our READ lands: never read.
                self._pull_deadlines.pop(req_id, None)
                self.xfer_stats.record_kv_expired_req()
                tm.log.warning("kvloop.read_declined_lease_ending", request_id=req_id)
                self.read_checks.forget(req_id)
                self._handle_failed_transfer(req_id, None, self._recv_failures, record_failed_transfer=False)
                return
            assert meta.remote is not None
            if meta.remote.engine_id in self._remote_agents:
                self._pull_deadlines.pop(req_id, None)  # the READ is posted now
                self._pull_holder_epochs.pop(req_id, None)
        if meta.remote is not None and meta.remote.engine_id not in self._remote_agents:
            self._handshake_reads.add(req_id)  # vLLM handshakes first, then calls here again
        super()._read_blocks_for_req(req_id, meta)

    def _read_blocks(
        self, read_spec: Any, dst_engine_id: str, request_id: str, *args: Any, **kwargs: Any
    ) -> bool:
        """vLLM's READ, with its pairing of local and holder blocks kept for the pull's check."""
        if self.read_checks.wants(request_id):
            self.read_checks.paired(
                request_id, read_spec.remote_rank, self._read_pairs(read_spec, dst_engine_id)
            )
        return super()._read_blocks(read_spec, dst_engine_id, request_id, *args, **kwargs)

    def _read_pairs(self, read_spec: Any, dst_engine_id: str) -> Pairs | None:
        """(local, holder) block pairs per group, as vLLM's ``_read_blocks`` pairs them for a READ of
        whole blocks straight into the KV cache; None for any other layout."""
        assert self.transfer_topo is not None
        remote = self.transfer_topo.get_engine_info(dst_engine_id)
        if (
            read_spec.block_ids_by_region
            or self.transfer_topo.block_size_ratio(remote.remote_block_size) != 1
            or self.dcp_size > 1
            or remote.remote_dcp_size > 1
            or remote.remote_tp_size != self.transfer_tp_size
            or self._physical_blocks_per_logical_kv_block != 1
            or remote.remote_physical_blocks_per_logical != 1
            or self._mixed_mem_types
            or self.use_host_buffer
            or self._has_mamba
        ):
            return None
        local, holder = self._apply_prefix_caching(
            decode_block_ids=read_spec.local_block_ids,
            prefill_block_ids=read_spec.remote_block_ids,
            decode_physical_per_logical=1,
            prefill_physical_per_logical=1,
        )
        return [list(zip(lg, hg, strict=False)) for lg, hg in zip(local, holder, strict=True)]

    def _get_new_notifs(self) -> set[str]:
        """vLLM's pull-mode notification handling, except multi-reader runs are not freed.

        Mirrors ``NixlPullConnectorWorker._get_new_notifs`` (vllm 0.32.0).
        """
        assert self.transfer_topo is not None
        notified_req_ids: set[str] = set()
        for notifs in self.nixl_wrapper.get_new_notifs().values():
            for notif in notifs:
                msg = notif.decode("utf-8")
                if msg.startswith("HB:"):
                    self._handle_heartbeat(msg[3:])
                    continue
                req_id, expected_consumers = msg.rsplit(":", 1)
                if req_id not in self._reqs_to_send and req_id not in self._reqs_to_process:
                    self.xfer_stats.record_notification_after_expiry()
                    tm.log.error(
                        "kvloop.read_after_release",
                        request_id=req_id,
                        detail="a peer read blocks of a run that is no longer retained",
                    )
                    continue
                self.expected_consumer_notifications_by_req[req_id] = int(expected_consumers)
                self.consumer_notification_counts_by_req[req_id] += 1
                if (
                    self.consumer_notification_counts_by_req[req_id]
                    == self.expected_consumer_notifications_by_req[req_id]
                ):
                    del self.consumer_notification_counts_by_req[req_id]
                    del self.expected_consumer_notifications_by_req[req_id]
                    if req_id in self._multi_reader:
                        # One complete read of a shared run: count it, keep the blocks.
                        self.kvloop_reads[req_id] += 1
                        tm.READS_SERVED.inc()
                        continue
                    notified_req_ids.add(req_id)
                    self._reqs_to_process.remove(req_id)
                    self._reqs_to_send.pop(req_id, None)
        return notified_req_ids

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        """vLLM's polling of outstanding transfers; NIXL's telemetry of each finished handle, which
        vLLM records only in aggregate, is also kept per request for the scheduler's cost reports."""
        owner = {handle: req_id for req_id, handles in transfers.items() for handle in handles}
        agent = self.nixl_wrapper
        telemetry_of = agent.get_xfer_telemetry

        def telemetry(handle: int) -> Any:
            res = telemetry_of(handle)
            req_id = owner.get(handle)
            if res is not None and req_id is not None:
                timing = ReadTiming(
                    res.xferDuration / 1e6,
                    res.postDuration / 1e6,
                    int(res.totalBytes),
                    req_id in self._handshake_reads,
                )
                known = self._read_timings.get(req_id)
                self._read_timings[req_id] = timing if known is None else known.merge(timing)
            return res

        agent.get_xfer_telemetry = telemetry  # for this call only: the class's method shows again below
        try:
            done, failed = super()._pop_done_transfers(transfers)
        finally:
            del agent.get_xfer_telemetry
        if transfers is self._recving_transfers:
            for req_id in done:
                if req_id in failed or req_id in self._recv_failures:  # not read: a failed READ
                    self.read_checks.forget(req_id)
                elif self.read_checks.check(req_id, self.digester) == VERIFY_FAILED:
                    failed.add(req_id)  # vLLM's failed-READ path: the blocks are recomputed
        return done, failed

    def take_worker_meta(self) -> KvloopWorkerMetadata | None:
        copied = self.host_pool.take_done() if self.host_pool is not None else {}
        host_digests = self.host_pool.take_digests() if self.host_pool is not None else {}
        verified = self.read_checks.take_found()
        digested = self.retained_digests.take()
        if not self._read_timings and not copied and not digested and not verified:
            return None
        reads, self._read_timings = self._read_timings, {}
        rank = self.tp_rank
        return KvloopWorkerMetadata(
            reads,
            copied,
            dict.fromkeys(copied, 1),
            digests={handle: {rank: groups} for handle, groups in digested.items()},
            host_digests={handle: {rank: groups} for handle, groups in host_digests.items()},
            verified=verified,
        )

    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        if self.host_pool is not None:
            # a run whose blocks are being copied into the pool is not freed before the copy ends
            copying = self.host_pool.copying_runs()
            now = time.perf_counter()
            for req_id in copying & self._reqs_to_send.keys():
                self._reqs_to_send[req_id] = max(self._reqs_to_send[req_id], now + 1.0)
        self._reap_retained(done_sending)

    def get_transfer_results(self) -> Any:
        self.kvloop_steps += 1
        if self.host_pool is not None:
            self.host_pool.poll()
        results = super().get_transfer_results()
        for req_id in results.failed_recving or ():
            self.read_checks.forget(req_id)  # e.g. a failed handshake: never read, never checked
        for req_id in results.finished_recving or ():
            self._pull_deadlines.pop(req_id, None)  # e.g. a failed handshake never posted
            self._pull_holder_epochs.pop(req_id, None)
            self._handshake_reads.discard(req_id)
        if self.host_pool is not None:
            results.finished_recving = self.host_pool.hold_for_captures(
                set(results.finished_recving or ()), set(results.failed_recving or ())
            )
        return results

    def _reap_retained(self, done_sending: set[str]) -> None:
        super()._reap_expired_send_leases(done_sending)
        for req_id in done_sending:
            if req_id in self._multi_reader:
                self._multi_reader.discard(req_id)
                reads = self.kvloop_reads.pop(req_id, 0)
                tm.log.debug("kvloop.retention_expired", request_id=req_id, reads=reads)
