"""A directory store that cannot be reached answers UNAVAILABLE, never an opaque UNKNOWN.

With a networked store (Redis) any RPC can find it away for a moment (a failover, a restart). The
interceptor turns the backend's :class:`StoreUnavailable` into ``UNAVAILABLE`` with its message, which
the connector and agents treat as "retry elsewhere or recompute": nothing is ever served from a
directory that could not be read."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog

from kvloop.daemon.auth import WrappedHandlers, _replace
from kvloop.daemon.index.store import StoreUnavailable

log = structlog.get_logger("kvloop.daemon")


def _guarded(behavior: Callable[..., Any], streaming_response: bool) -> Callable:
    if streaming_response:

        async def stream(request: Any, context: grpc.aio.ServicerContext):
            try:
                async for response in behavior(request, context):
                    yield response
            except StoreUnavailable as exc:
                log.warning("directory store unavailable", error=str(exc))
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext):
        try:
            return await behavior(request, context)
        except StoreUnavailable as exc:
            log.warning("directory store unavailable", error=str(exc))
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    return unary


class StoreUnavailableInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self._guarded = WrappedHandlers(lambda handler, method: _replace(handler, _guarded))

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        return handler if handler is None else self._guarded.of(handler, details.method or "")
