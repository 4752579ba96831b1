"""Typed Python client of kvloopd, sync and asyncio, shared by agents, the CLI and the proxy.

    with DirectoryClient("127.0.0.1:50051") as kv:
        answer = kv.lookup("my-model", hashes, local_blocks=0)

    async with AsyncDirectoryClient("127.0.0.1:50051") as kv:
        answer = await kv.lookup("my-model", hashes)

Both classes share every request builder; only how a call is made differs. gRPC errors become
`KvloopError` (`DaemonUnavailable` when the daemon cannot be reached) with the daemon's message.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import grpc

from kvloop.common.addresses import grpc_target
from kvloop.common.block_keys import KEY_BYTES, packed_keys
from kvloop.common.packed_ids import pack_u32, unpack_u32
from kvloop.common.security import ClientSecurity
from kvloop.v1 import directory_pb2 as pb
from kvloop.v1 import directory_pb2_grpc as pb_grpc

DEFAULT_DAEMON = "127.0.0.1:50051"


def default_target() -> str:
    return os.environ.get("KVLOOP_DAEMON", DEFAULT_DAEMON)


class KvloopError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, target: str) -> None:
        super().__init__(message)
        self.code = code
        self.target = target


class DaemonUnavailable(KvloopError):
    pass


def _translate(exc: grpc.RpcError, target: str) -> KvloopError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return DaemonUnavailable(code, f"cannot reach kvloopd at {target}: {details}", target)
    return KvloopError(code, f"{code.name}: {details}", target)


def holder_block_ids(holder: pb.Holder) -> list[int]:
    """A holder's physical block ids, whichever form the response used."""
    if holder.packed_block_ids:
        return unpack_u32(holder.packed_block_ids).tolist()
    return list(holder.block_ids)


def _set_prompt(
    request: pb.LookupRequest | pb.RouteRequest, block_hashes: Sequence[bytes] | bytes, hash_length: int
) -> None:
    """Concatenated hashes of a stated ``hash_length`` travel as their keys (kvloop.common.block_keys);
    a list goes whole, so the daemon checks each hash's length against the model's."""
    if not isinstance(block_hashes, (bytes, bytearray)):
        request.block_hashes.extend(block_hashes)
    elif hash_length:
        if len(block_hashes) % hash_length:
            raise ValueError(
                f"{len(block_hashes)} bytes of hashes are not a multiple of hash_length {hash_length}"
            )
        request.packed_block_hashes = packed_keys(bytes(block_hashes), hash_length)
        request.packed_hash_bytes = KEY_BYTES
    else:
        request.packed_block_hashes = bytes(block_hashes)


def _identity(response: Any) -> Any:
    return response


def _options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        # Several kvloopd replicas (a list of addresses or a name with several records): spread the
        # calls over the live ones, and a call made while one is down goes to another.
        ("grpc.service_config", '{"loadBalancingConfig": [{"round_robin": {}}]}'),
        # round_robin keeps reconnecting a replica that went away, backing off up to gRPC's default
        # 120 s, and fails calls fast meanwhile: a kvloopd restarted after a few seconds would then be
        # unreachable for longer than it was down. Retrying at least every second bounds that.
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.min_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 1_000),
    ]


class _ClientBase:
    """Request builders and public methods; subclasses define `_invoke`."""

    def __init__(
        self,
        target: str | None = None,
        security: ClientSecurity | None = None,
        timeout: float = 5.0,
        max_message_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self.target = target or default_target()
        self._grpc_target = grpc_target(self.target)
        self.security = security or ClientSecurity.from_env()
        self.timeout = timeout
        self._metadata = self.security.call_metadata()
        self._channel = self._open(_options(max_message_bytes))
        self.stub = pb_grpc.DirectoryStub(self._channel)

    def _open(self, options: list) -> Any:
        raise NotImplementedError

    def _invoke(
        self,
        method: str,
        request: Any,
        transform: Callable[[Any], Any] = _identity,
        timeout: float | None = None,
    ) -> Any:
        raise NotImplementedError

    def lookup(
        self,
        model: str,
        block_hashes: Sequence[bytes] | bytes,
        *,
        local_blocks: int = 0,
        requester: str = "",
        claim: bool = False,
        lora_name: str = "",
        block_size: int = 0,
        pack_block_ids: bool = False,
        min_pull_tokens: int = 0,
        lease_margin_ms: int = 0,
        parallel: pb.ParallelLayout | None = None,
        kv_dtype: str = "",
        kv_bytes_per_block: int = 0,
        kv_group_windows: Sequence[int] = (),
        hash_length: int = 0,
        timeout: float | None = None,
    ) -> pb.LookupResponse:
        """Ask for the longest servable prefix.

        `block_hashes` may be a list or the hashes concatenated (the fast path); concatenated hashes
        with their `hash_length` given travel as each hash's leading 8 bytes, all the directory
        compares. With `pack_block_ids` holders carry `packed_block_ids` (read them with
        `holder_block_ids`).
        A puller states its constraints (minimum pull, lease margin, its KV layout): the daemon
        answers within them.
        """
        request = pb.LookupRequest(model=model, requester_worker_id=requester)
        # Only what differs from the proto's defaults is set: a connector builds one per prefill, and
        # each field set costs as much as sending it.
        if lora_name:
            request.lora_name = lora_name
        if local_blocks:
            request.local_blocks = local_blocks
        if claim:
            request.claim = True
        if block_size:
            request.block_size = block_size
        if pack_block_ids:
            request.pack_block_ids = True
        if min_pull_tokens:
            request.min_pull_tokens = min_pull_tokens
        if lease_margin_ms:
            request.lease_margin_ms = lease_margin_ms
        if parallel is not None:
            request.parallel.CopyFrom(parallel)
        if kv_dtype:
            request.kv_dtype = kv_dtype
        if kv_bytes_per_block:
            request.kv_bytes_per_block = kv_bytes_per_block
        if kv_group_windows:
            request.kv_group_windows.extend(kv_group_windows)
        _set_prompt(request, block_hashes, hash_length)
        return self._invoke("Lookup", request, timeout=timeout)

    def route(
        self,
        model: str,
        candidates: Sequence[pb.RouteCandidate | str],
        *,
        token_ids: Sequence[int] = (),
        block_hashes: Sequence[bytes] | bytes = (),
        cache_salt: str = "",
        lora_name: str = "",
        prompt_tokens: int = 0,
        block_size: int = 0,
        hash_length: int = 0,
        continuation: bool = False,
        timeout: float | None = None,
    ) -> pb.RouteResponse:
        """Rank candidate prefill workers for a prompt by expected time to first token (read-only).

        Give the prompt as `token_ids` (kvloopd hashes them as the model's vLLM engines do; they
        travel packed, which kvloopd reads from this version on) or as `block_hashes`; a candidate
        is a worker id or a `pb.RouteCandidate` with its queue. `continuation`: the prompt is a
        conversation as its last turn left it, scored ahead of its next turn (see
        clients/proxy/continuation.py)."""
        try:
            packed_tokens = pack_u32(token_ids)
        except (OverflowError, TypeError):
            raise ValueError("token ids must be integers in 0..2**32-1") from None
        request = pb.RouteRequest(
            model=model,
            lora_name=lora_name,
            packed_token_ids=packed_tokens,
            cache_salt=cache_salt,
            prompt_tokens=prompt_tokens,
            block_size=block_size,
            candidates=[pb.RouteCandidate(worker_id=c) if isinstance(c, str) else c for c in candidates],
            continuation=continuation,
        )
        if block_hashes:
            _set_prompt(request, block_hashes, hash_length)
        return self._invoke("Route", request, timeout=timeout)

    def release_claim(
        self,
        model: str,
        holder: str,
        handle: str,
        *,
        requester: str = "",
        lora_name: str = "",
        directory_epoch: int = 0,
    ) -> bool:
        """Give back a single-use run a TRANSFER answer claimed for `requester` (idempotent).
        `directory_epoch`: the answer's; a claim from an epoch the directory has moved past is not
        released (0: not checked)."""
        request = pb.ReleaseClaimRequest(
            model=model,
            lora_name=lora_name,
            holder_worker_id=holder,
            retention_handle=handle,
            requester_worker_id=requester,
            directory_epoch=directory_epoch,
        )
        return self._invoke("ReleaseClaim", request, lambda r: r.released)

    def list_workers(self, model: str = "") -> list[pb.WorkerInfo]:
        return self._invoke("ListWorkers", pb.ListWorkersRequest(model=model), lambda r: list(r.workers))

    def find_block(self, model: str, block_hash: bytes, lora_name: str = "") -> list[pb.BlockLocation]:
        return self._invoke(
            "FindBlock",
            pb.FindBlockRequest(model=model, lora_name=lora_name, block_hash=block_hash),
            lambda r: list(r.locations),
        )

    def find_block_response(self, model: str, block_hash: bytes, lora_name: str = "") -> pb.FindBlockResponse:
        """FindBlock's whole answer: the locations and the directory's read window."""
        return self._invoke(
            "FindBlock", pb.FindBlockRequest(model=model, lora_name=lora_name, block_hash=block_hash)
        )

    def pairs(self, model: str = "") -> pb.ListPairsResponse:
        """The cost model's estimates per holder -> puller pair and per puller."""
        return self._invoke("ListPairs", pb.ListPairsRequest(model=model))

    def stats(self) -> pb.GetStatsResponse:
        return self._invoke("GetStats", pb.GetStatsRequest())

    def drain(self, worker_id: str, reason: str = "") -> bool:
        return self._invoke(
            "DrainWorker", pb.DrainWorkerRequest(worker_id=worker_id, reason=reason), lambda r: r.delivered
        )


class DirectoryClient(_ClientBase):
    """Blocking client."""

    def _open(self, options: list) -> grpc.Channel:
        if self.security.tls:
            return grpc.secure_channel(
                self._grpc_target, self.security.channel_credentials(), options=options
            )
        return grpc.insecure_channel(self._grpc_target, options=options)

    def _invoke(self, method, request, transform=_identity, timeout=None):
        try:
            response = getattr(self.stub, method)(
                request, timeout=timeout or self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise _translate(exc, self.target) from None
        return transform(response)

    def watch(self, model: str = "") -> Iterator[pb.WatchResponse]:
        try:
            yield from self.stub.Watch(pb.WatchRequest(model=model), metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _translate(exc, self.target) from None

    def plans(self, worker_id: str) -> Any:
        """The ``Plans`` stream of one prefill worker, as gRPC's call object: iterating it yields
        PlansResponses (and raises grpc.RpcError when the stream ends in error); ``cancel()`` ends it."""
        return self.stub.Plans(pb.PlansRequest(worker_id=worker_id), metadata=self._metadata)

    def wait_ready(self, timeout: float = 10.0) -> None:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise DaemonUnavailable(
                grpc.StatusCode.UNAVAILABLE,
                f"cannot reach kvloopd at {self.target} within {timeout:.0f}s",
                self.target,
            ) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> DirectoryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncDirectoryClient(_ClientBase):
    """asyncio client (grpc.aio); every method of DirectoryClient returns an awaitable here."""

    def _open(self, options: list) -> grpc.aio.Channel:
        if self.security.tls:
            return grpc.aio.secure_channel(
                self._grpc_target, self.security.channel_credentials(), options=options
            )
        return grpc.aio.insecure_channel(self._grpc_target, options=options)

    async def _invoke(self, method, request, transform=_identity, timeout=None):
        try:
            response = await getattr(self.stub, method)(
                request, timeout=timeout or self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise _translate(exc, self.target) from None
        return transform(response)

    async def watch(self, model: str = "") -> AsyncIterator[pb.WatchResponse]:
        try:
            async for change in self.stub.Watch(pb.WatchRequest(model=model), metadata=self._metadata):
                yield change
        except grpc.RpcError as exc:
            raise _translate(exc, self.target) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncDirectoryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
