"""A stand-in for kvloopd used by the engine tests.

It is fed by the decode engine's real KV-event stream (vLLM's ZMQ publisher: the connector's
``take_events()`` output is merged into it) and answers the real gRPC ``Directory.Lookup`` that
the prefill engine's connector calls, applying InMemoryBlockDirectory's rules.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
import zmq
from kvloop.agents.connector.directory import InMemoryBlockDirectory, LookupResult
from kvloop.agents.connector.events import KvloopRetentionReleased, decode_event_batch
from kvloop.v1 import directory_pb2 as pb
from kvloop.v1 import directory_pb2_grpc as pbg

_REASONS = {
    "miss": pb.DECISION_REASON_MISS,
    "below_threshold": pb.DECISION_REASON_BELOW_THRESHOLD,
    "transfer_faster": pb.DECISION_REASON_TRANSFER_FASTER,
    "local_prefix": pb.DECISION_REASON_LOCAL_PREFIX,
    "expired": pb.DECISION_REASON_EXPIRED,
}


def to_proto(res: LookupResult, block_size: int, n_prompt_blocks: int) -> pb.LookupResponse:
    decision = {
        "transfer": pb.DECISION_TRANSFER,
        "local": pb.DECISION_LOCAL,
    }.get(res.path, pb.DECISION_RECOMPUTE)
    resp = pb.LookupResponse(
        decision=decision,
        reason=_REASONS.get(res.reason, pb.DECISION_REASON_UNSPECIFIED),
        matched_blocks=res.matched_blocks,
        matched_tokens=res.matched_blocks * block_size,
        recompute_tokens=max(0, n_prompt_blocks - res.matched_blocks) * block_size,
    )
    if res.holder is not None:
        h = res.holder
        resp.holder.CopyFrom(
            pb.Holder(
                worker_id=h.worker_id,
                engine_id=h.engine_id,
                nixl_endpoint=f"{h.host}:{h.port}",
                matched_blocks=res.matched_blocks,
                retention_handle=h.retention_handle,
                expires_in_ms=h.expires_in_ms,
                block_ids=[b for g in h.block_ids for b in g[: res.matched_blocks]],
                num_groups=len(h.block_ids),
                single_use=h.single_use,
            )
        )
    return resp


class FakeDirectory(pbg.DirectoryServicer):
    def __init__(self, events_endpoint: str, min_pull_tokens: int = 64) -> None:
        self.index = InMemoryBlockDirectory(expiry_margin_s=6.0, min_pull_tokens=min_pull_tokens)
        self.override: Callable[[pb.LookupResponse], pb.LookupResponse] | None = None
        self.lookups: list[pb.LookupResponse] = []
        self.kv_event_types: set[str] = set()
        self.released: dict[str, object] = {}  # handle -> KvloopRetentionReleased
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVTIMEO, 200)
        self._sub.connect(events_endpoint)
        self._thread = threading.Thread(target=self._pump, daemon=True, name="fake-dir-sub")
        self._thread.start()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pbg.add_DirectoryServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.target = f"127.0.0.1:{self.port}"

    def _pump(self) -> None:
        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._sub.recv_multipart()
            except zmq.Again:
                continue
            batch = decode_event_batch(payload)
            self.kv_event_types.update(e.get("type", "?") for e in batch.vllm)
            self.kv_event_types.update(type(e).__name__ for e in batch.kvloop)
            self.index.ingest(batch.kvloop)
            for e in batch.kvloop:
                if isinstance(e, KvloopRetentionReleased):
                    self.released[e.retention_handle] = e

    def wait_for_handle(self, handle: str, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if handle in self.index.handles():
                return
            time.sleep(0.02)
        raise TimeoutError(f"retained event for {handle} never arrived")

    def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        res = self.index.lookup(
            list(request.block_hashes),
            request.local_blocks,
            requester=request.requester_worker_id,
            block_size=request.block_size,
        )
        assert res is not None
        resp = to_proto(res, request.block_size, len(request.block_hashes))
        if self.override is not None:
            resp = self.override(resp)
        self.lookups.append(resp)
        return resp

    def close(self) -> None:
        self._stop.set()
        self.server.stop(0)
        self._thread.join(timeout=2)
        self._sub.close(0)
        self._ctx.term()
