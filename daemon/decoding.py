"""Request parsing for the Directory service, moved into the handlers so that bytes which are not a
valid message get INVALID_ARGUMENT.

grpc's own deserializer turns a ``DecodeError`` (corrupt wire format, a string that is not UTF-8)
into UNKNOWN for unary calls, and on the Connect stream into an exception inside the session that
ended as INTERNAL. :class:`DecodeInterceptor` gives the server the raw bytes and parses them in the
handler instead: a unary call is refused with INVALID_ARGUMENT, a Connect message raises
:class:`~kvloop.daemon.convert.BadInput` (which the session answers with INVALID_ARGUMENT). Both are
counted in ``kvloop_rejected_messages_total{reason="undecodable"}``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvloop.daemon.auth import SERVICE_PREFIX, WrappedHandlers
from kvloop.daemon.convert import BadInput


def _message(rpc: str, exc: DecodeError) -> str:
    return f"{rpc}: the request is not a valid message: {exc}"


class DecodeInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, on_reject: Callable[[str, str], None]) -> None:
        self._on_reject = on_reject
        self._wrapped = WrappedHandlers(self._wrap)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or not method.startswith(SERVICE_PREFIX) or handler.request_deserializer is None:
            return handler
        return self._wrapped.of(handler, method)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        rpc = method.removeprefix(SERVICE_PREFIX)
        parse = handler.request_deserializer
        on_reject = self._on_reject

        async def refuse(exc: DecodeError, context: grpc.aio.ServicerContext) -> None:
            on_reject(rpc, "undecodable")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(rpc, exc))

        # Parsed inline in each handler, with a coroutine only for the refusal: every Lookup goes
        # through here.
        if handler.unary_unary is not None:
            unary_behavior = handler.unary_unary

            async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                try:
                    request = parse(raw)
                except DecodeError as exc:
                    await refuse(exc, context)
                    raise  # abort() raised already
                return await unary_behavior(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, response_serializer=handler.response_serializer
            )
        if handler.unary_stream is not None:
            server_streaming = handler.unary_stream

            async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    request = parse(raw)
                except DecodeError as exc:
                    await refuse(exc, context)
                    raise  # abort() raised already
                async for response in server_streaming(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, response_serializer=handler.response_serializer
            )
        if handler.stream_stream is not None:
            bidi = handler.stream_stream

            async def parsed(requests: AsyncIterator[bytes]) -> AsyncIterator[Any]:
                async for raw in requests:
                    try:
                        yield parse(raw)
                    except DecodeError as exc:
                        # The session refuses it like any other bad message (and counts it).
                        raise BadInput("undecodable", _message(rpc, exc)) from None

            async def stream_stream(
                requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Any]:
                async for response in bidi(parsed(requests), context):
                    yield response

            return grpc.stream_stream_rpc_method_handler(
                stream_stream, response_serializer=handler.response_serializer
            )
        return handler  # no client-streaming RPC in the service
