"""Warm peers: open NIXL connections to holders before a user's turn needs them.

A prefill's first READ from a decode peer also pays NIXL's handshake (side-channel metadata exchange
and the UCX connection: docs/benchmarks.md, "Smaller measurements"), and without this it pays it
inside a user's turn.
:class:`PeerWarmer` runs in each prefill worker process, off the engine loop: it asks kvloopd for the
registered workers every ``interval_s`` and hands each new holder (a decode or both-role engine of the
same model) to ``warm`` - the worker's vLLM handshake machinery, which runs it in vLLM's own
handshake thread and keeps the connection for later READs.

A holder whose registration epoch changed is a new process behind the same engine id and NIXL
port (its agent re-registers when its engine was killed and relaunched, agents/sidecar/engine_watch.py).
vLLM keeps the dead process's NIXL agent for that engine id: NIXL keeps a remote agent's metadata
after a READ to it failed with ``nixlRemoteDisconnectError`` (measured), so vLLM's own failed-peer
check never releases it and every later READ fails. ``restarted`` hands such a peer to the worker,
which drops the old agent and handshakes the new process.

ListWorkers is polled rather than Watched (a prefill's token may list workers but not Watch), with
the sampled flag off, so the polls start no traces at kvloopd.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.directory import TracedDirectoryClient
from kvloop.clients.directory_client import DirectoryClient, KvloopError
from kvloop.common.tracing import not_sampled
from kvloop.v1 import directory_pb2 as pb

HOLDER_ROLES = (pb.WORKER_ROLE_DECODE, pb.WORKER_ROLE_BOTH)
PULLER_ROLES = (pb.WORKER_ROLE_PREFILL, pb.WORKER_ROLE_BOTH)


@dataclass(frozen=True)
class Peer:
    worker_id: str
    engine_id: str
    host: str
    port: int
    tp_size: int
    # The holder's registration epoch: a new one means a new agent (and engine process) behind it.
    epoch: int = 0


def peers_to_warm(
    workers: list[pb.WorkerInfo], own_worker_id: str, own_engine_id: str, model: str
) -> list[Peer]:
    """The holders this engine may read from, once its own registration says it pulls (a decode's
    worker opens no connections)."""
    regs = [w.registration for w in workers]
    own = next((r for r in regs if r.worker_id == own_worker_id), None)
    if own is None or own.role not in PULLER_ROLES:
        return []
    peers = []
    for r in regs:
        if r.role not in HOLDER_ROLES or r.engine_id in ("", own_engine_id) or r.worker_id == own_worker_id:
            continue
        if model and r.model != model:
            continue
        # the engine's KV cache, and its host pool (an engine of its own) where it has one
        for engine_id, endpoint in ((r.engine_id, r.nixl_endpoint), (r.host_engine_id, r.host_nixl_endpoint)):
            host, sep, port = endpoint.rpartition(":")
            if engine_id and sep and port.isdigit():
                tp = r.parallel.tensor_parallel_size or 1
                peers.append(Peer(r.worker_id, engine_id, host, int(port), tp, r.epoch))
    return peers


class PeerWarmer:
    def __init__(
        self,
        daemon: str,
        worker_id: str,
        engine_id: str,
        model: str,
        warm: Callable[[Peer], None],
        interval_s: float = 2.0,
        restarted: Callable[[Peer], None] | None = None,
    ) -> None:
        self.daemon = daemon
        self.worker_id = worker_id
        self.engine_id = engine_id
        self.model = model
        self.warm = warm
        self.restarted = restarted
        self.interval_s = interval_s
        self.warmed: dict[str, int] = {}  # engine id handed to `warm` -> its registration epoch then
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvloop-warm-peers", daemon=True)

    def start(self) -> PeerWarmer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def poll_once(self, client: DirectoryClient) -> list[Peer]:
        """Warm the peers not seen before, hand those registered under a new epoch to ``restarted``;
        returns both."""
        new: list[Peer] = []
        restarted: list[Peer] = []
        for peer in peers_to_warm(
            client.list_workers(self.model), self.worker_id, self.engine_id, self.model
        ):
            known = self.warmed.get(peer.engine_id)
            if known is None:
                new.append(peer)
            elif known != peer.epoch:
                restarted.append(peer)
        for peer in restarted:
            tm.log.warning(
                "kvloop.peer_restarted",
                peer=peer.worker_id,
                engine_id=peer.engine_id,
                old_epoch=self.warmed[peer.engine_id],
                epoch=peer.epoch,
            )
            self.warmed[peer.engine_id] = peer.epoch
            if self.restarted is not None:
                self.restarted(peer)
        for peer in new:
            self.warmed[peer.engine_id] = peer.epoch
            try:
                self.warm(peer)
            except Exception as e:  # a peer we cannot reach now is handshaken on its first READ
                tm.log.warning("kvloop.warm_peer_failed", peer=peer.worker_id, error=repr(e))
        return new + restarted

    def _run(self) -> None:
        with TracedDirectoryClient(self.daemon, timeout=5.0) as client:
            while True:
                try:
                    with not_sampled():
                        self.poll_once(client)
                except KvloopError as e:
                    tm.log.debug("kvloop.warm_peers_list_failed", error=str(e))
                if self._stop.wait(self.interval_s):  # the poll period; stop() wakes it at once
                    return
