"""Bearer-token authentication and per-role authorization for kvloopd, as a gRPC server interceptor.

Every ``kvloop.v1.Directory`` call passes through :class:`AuthInterceptor`: a missing or unknown
token is refused with UNAUTHENTICATED, a role the method does not admit with PERMISSION_DENIED,
before the handler runs. Handlers read the caller's grant with :func:`current_grant` for the two
checks that depend on the request itself (a claiming Lookup needs the prefill role; an agent token
bound to a worker id may only register that worker). Health and reflection stay open.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import grpc

from kvloop.common.security import Role, TokenGrant
from kvloop.v1 import directory_pb2 as pb

SERVICE_PREFIX = "/" + pb.DESCRIPTOR.services_by_name["Directory"].full_name + "/"

# Roles admitted per method (admin is admitted everywhere).
METHOD_ROLES: Mapping[str, tuple[Role, ...]] = {
    "Connect": (Role.AGENT,),
    "Lookup": (Role.PREFILL, Role.READ),
    "Route": (Role.PREFILL, Role.READ),
    "Plans": (Role.PREFILL,),
    "ReleaseClaim": (Role.PREFILL,),
    "ListWorkers": (Role.READ, Role.PREFILL),
    # agents too: a decode's connector confirms the directory dropped a run it gave up (yielding.py)
    "FindBlock": (Role.READ, Role.PREFILL, Role.AGENT),
    "GetStats": (Role.READ, Role.PREFILL),
    "ListPairs": (Role.READ, Role.PREFILL),
    "Watch": (Role.READ,),
    "DrainWorker": (),
}

_GRANT: ContextVar[TokenGrant | None] = ContextVar("kvloop_grant", default=None)


def current_grant() -> TokenGrant | None:
    """The grant of the call being handled (None when authentication is off)."""
    return _GRANT.get()


def _with_grant(behavior: Callable[..., Any], grant: TokenGrant, streaming_response: bool) -> Callable:
    if streaming_response:

        async def stream(request: Any, context: grpc.aio.ServicerContext):
            _GRANT.set(grant)
            async for response in behavior(request, context):
                yield response

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext):
        _GRANT.set(grant)
        return await behavior(request, context)

    return unary


def _refusal(code: grpc.StatusCode, message: str, streaming_response: bool) -> Callable:
    if streaming_response:

        async def stream(request: Any, context: grpc.aio.ServicerContext):
            await context.abort(code, message)
            yield  # pragma: no cover - abort raises

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext):
        await context.abort(code, message)

    return unary


def _replace(handler: grpc.RpcMethodHandler, make: Callable[[Callable, bool], Callable]) -> Any:
    """The same method handler with its behavior replaced (all four call shapes)."""
    kinds = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler, False),
        ("unary_stream", grpc.unary_stream_rpc_method_handler, True),
        ("stream_unary", grpc.stream_unary_rpc_method_handler, False),
        ("stream_stream", grpc.stream_stream_rpc_method_handler, True),
    )
    for attribute, build, streaming_response in kinds:
        behavior = getattr(handler, attribute)
        if behavior is not None:
            return build(
                make(behavior, streaming_response),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


class WrappedHandlers:
    """An interceptor's wrapped method handlers, built once per method: interceptors run on every
    call (each Lookup's), and the server hands them the same handler for a method each time."""

    def __init__(self, wrap: Callable[[grpc.RpcMethodHandler, str], grpc.RpcMethodHandler]) -> None:
        self._wrap = wrap
        self._built: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def of(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        built = self._built.get(method)
        if built is None or built[0] is not handler:
            built = self._built[method] = (handler, self._wrap(handler, method))
        return built[1]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: Sequence[TokenGrant], on_reject: Callable[[str, str], None]) -> None:
        self._tokens = {t.token: t for t in tokens}
        self._on_reject = on_reject

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or not method.startswith(SERVICE_PREFIX):
            return handler
        rpc = method.removeprefix(SERVICE_PREFIX)
        header = dict(details.invocation_metadata or ()).get("authorization", "")
        scheme, _, token = str(header).partition(" ")
        grant = self._tokens.get(token) if scheme.lower() == "bearer" else None
        if grant is None:
            self._on_reject(rpc, "unauthenticated")
            message = "missing or unknown bearer token (metadata 'authorization: Bearer <token>')"
            return _replace(handler, lambda _, s: _refusal(grpc.StatusCode.UNAUTHENTICATED, message, s))
        allowed = METHOD_ROLES.get(rpc, ())
        if grant.role is not Role.ADMIN and grant.role not in allowed:
            self._on_reject(rpc, "permission_denied")
            needs = ", ".join(a.value for a in allowed) or "admin"
            message = f"role {grant.role.value!r} may not call {rpc} (needs {needs})"
            return _replace(handler, lambda _, s: _refusal(grpc.StatusCode.PERMISSION_DENIED, message, s))
        return _replace(handler, lambda behavior, s: _with_grant(behavior, grant, s))
