"""kvloopd's gRPC server: the Directory service plus health, reflection, metrics and tracing."""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from kvloop.common.addresses import parse_host_port
from kvloop.common.sd_notify import Notifier
from kvloop.common.tracing import configure_tracing, shutdown_tracing
from kvloop.common.version import VERSION, publish_build_info
from kvloop.daemon import metrics
from kvloop.daemon.auth import AuthInterceptor
from kvloop.daemon.config import DaemonSettings
from kvloop.daemon.decoding import DecodeInterceptor
from kvloop.daemon.index import DirectoryStore, MemoryStore, StoreUnavailable
from kvloop.daemon.index.instrumented import InstrumentedStore
from kvloop.daemon.index.redis_cluster_store import RedisClusterStore
from kvloop.daemon.index.redis_store import RedisStore
from kvloop.daemon.index.store import entry_bound
from kvloop.daemon.metrics import DaemonCounters
from kvloop.daemon.plans import PlanBoard
from kvloop.daemon.policy import Policy
from kvloop.daemon.service import DirectoryService
from kvloop.daemon.unavailable import StoreUnavailableInterceptor
from kvloop.daemon.watch import ChangeFeed
from kvloop.v1 import directory_pb2 as pb
from kvloop.v1 import directory_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = structlog.get_logger("kvloop.daemon")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Directory"].full_name


class DaemonStartError(RuntimeError):
    pass


async def open_store(settings: DaemonSettings) -> DirectoryStore:
    """The configured backend: in memory unless ``[store] url`` names a Redis."""
    if settings.store.url == "memory":
        return MemoryStore(settings.index_config())
    from redis.exceptions import RedisClusterException, RedisError

    from kvloop.daemon.index.redis_wire import redacted

    try:
        if settings.store.cluster:
            return await RedisClusterStore.connect_cluster(
                settings.store.url,
                settings.index_config(),
                settings.store.cluster_buckets,
                settings.store.cluster_spread,
                **settings.store.redis_options(),
            )
        if settings.store.sentinels:
            return await RedisStore.connect_sentinel(
                settings.store.sentinels,
                settings.store.sentinel_master,
                settings.store.url,
                settings.index_config(),
                **settings.store.redis_options(),
            )
        return await RedisStore.connect(
            settings.store.url, settings.index_config(), **settings.store.redis_options()
        )
    except (RedisError, RedisClusterException, OSError) as exc:
        raise DaemonStartError(f"cannot use the store at {redacted(settings.store.url)}: {exc}") from None


async def serve(settings: DaemonSettings, stop: asyncio.Event | None = None) -> None:
    """Run kvloopd until SIGTERM/SIGINT (or `stop` is set), then shut down gracefully."""
    traced = _start_tracing(settings)
    counters = DaemonCounters()
    publish_build_info("kvloopd")
    backend = await open_store(settings)
    metrics.MAX_ENTRIES.set(entry_bound(backend))
    server = grpc.aio.server(
        options=_server_options(settings), interceptors=_interceptors(settings, backend, counters)
    )
    shared = isinstance(backend, (RedisStore, RedisClusterStore))  # replicas share it: relay between them
    changes = ChangeFeed(relay=backend.change_relay() if shared else None)
    plans = PlanBoard(relay=backend.plan_relay() if shared else None)
    store = InstrumentedStore(backend, traced=traced)
    service = DirectoryService(
        store,
        Policy(settings.policy, settings.models),
        heartbeat_interval_s=settings.heartbeat_interval_s,
        max_hashes=settings.max_hashes_per_message,
        route_hash_cache_blocks=settings.route_hash_cache_blocks,
        counters=counters,
        changes=changes,
        plans=plans,
        traced=traced,
    )
    pb_grpc.add_DirectoryServicer_to_server(service, server)
    health = _add_health_and_reflection(server)
    bound = _bind(server, settings)
    await server.start()
    metrics_server = await _start_metrics(server, settings)
    for problem in settings.exposure_warnings():
        log.warning("kvloopd is exposed", problem=problem)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "kvloopd listening",
        version=VERSION,
        listen=settings.listen,
        port=bound,
        metrics=settings.metrics_listen or None,
        tls=settings.tls is not None,
        auth=bool(settings.tokens),
        lease_s=settings.lease_s,
        store=store.name,
    )

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reaping = asyncio.create_task(_reap_forever(service, settings.reap_interval_s))
    relaying = asyncio.create_task(changes.relay())
    relaying_plans = asyncio.create_task(plans.relay())
    # systemd (Type=notify): ready once the port answers and health says SERVING; the watchdog is
    # pinged from this loop, so a stuck loop is restarted.
    notifier = Notifier()
    notifier.ready(f"serving on {settings.listen} (store {store.name})")
    pinging = notifier.start_watchdog()
    try:
        await stop.wait()
    finally:
        notifier.stopping("shutting down")
        log.info("kvloopd shutting down", grace_s=settings.shutdown_grace_s)
        pinging.cancel()
        reaping.cancel()
        relaying.cancel()
        relaying_plans.cancel()
        await health.enter_graceful_shutdown()
        service.close_streams()
        await server.stop(settings.shutdown_grace_s)
        if metrics_server is not None:
            metrics_server.shutdown()
        await store.close()
        shutdown_tracing()
        notifier.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        log.info("kvloopd stopped")


def _start_tracing(settings: DaemonSettings) -> bool:
    """Whether spans are exported; when they are, every gRPC call gets its own."""
    traced = configure_tracing("kvloopd", settings.span_file)
    if traced:
        from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorServer

        GrpcAioInstrumentorServer().instrument()
    return traced


def _server_options(settings: DaemonSettings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ]


def _interceptors(
    settings: DaemonSettings, backend: DirectoryStore, counters: DaemonCounters
) -> list[grpc.aio.ServerInterceptor]:
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if settings.tokens:
        interceptors.append(AuthInterceptor(settings.tokens, counters.rejected_message))
    interceptors.append(DecodeInterceptor(counters.rejected_message))
    if not isinstance(backend, MemoryStore):  # only a networked store can be away
        interceptors.append(StoreUnavailableInterceptor())
    return interceptors


def _add_health_and_reflection(server: grpc.aio.Server) -> health_aio.HealthServicer:
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    return health


def _bind(server: grpc.aio.Server, settings: DaemonSettings) -> int:
    """The port bound for ``settings.listen`` (its own when that asks for port 0)."""
    host, port = parse_host_port(settings.listen, "listen")
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if settings.tls is not None:
            bound = server.add_secure_port(address, settings.tls.server_credentials())
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise DaemonStartError(f"cannot listen on {settings.listen}: {exc}") from None
    if bound == 0:
        raise DaemonStartError(f"cannot listen on {settings.listen} (address in use or not local)")
    return bound


async def _start_metrics(server: grpc.aio.Server, settings: DaemonSettings) -> WSGIServer | None:
    """The /metrics endpoint, if configured; the started gRPC server is stopped when it cannot be."""
    if not settings.metrics_listen:
        return None
    mhost, mport = parse_host_port(settings.metrics_listen, "metrics_listen")
    tls = settings.tls
    try:
        metrics_server, _ = start_http_server(
            mport,
            addr=mhost,
            certfile=str(tls.cert_file) if tls else None,
            keyfile=str(tls.key_file) if tls else None,
            client_cafile=str(tls.client_ca_file) if tls and tls.client_ca_file else None,
            client_auth_required=bool(tls and tls.client_ca_file),
        )
    except OSError as exc:
        await server.stop(None)
        raise DaemonStartError(f"cannot serve metrics on {settings.metrics_listen}: {exc}") from None
    return metrics_server


async def _reap_forever(service: DirectoryService, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await service.reap()
        except StoreUnavailable as exc:  # a failover in progress: reap again next interval
            log.warning("reaping skipped", error=str(exc))
        except Exception:  # a bug must not end reaping for good
            log.exception("reaping failed; retrying next interval")
