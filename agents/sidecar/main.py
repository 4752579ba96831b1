"""`kvloop-agent`: one per vLLM instance. Subscribes to the engine's KV events, keeps kvloopd's
directory current over the Connect stream, and exits cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
import ssl
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import structlog
import typer
from prometheus_client import Gauge
from pydantic import ValidationError

from kvloop.common.addresses import parse_host_port
from kvloop.common.config_files import error_lines
from kvloop.common.logging import configure_logging
from kvloop.common.sd_notify import Notifier
from kvloop.common.version import VERSION, publish_build_info, version_line

if TYPE_CHECKING:
    from kvloop.agents.sidecar.config import AgentSettings
    from kvloop.v1 import directory_pb2 as pb

log = structlog.get_logger("kvloop.agent")
app = typer.Typer(
    add_completion=False, help="kvloop sidecar: streams one vLLM worker's block events to kvloopd."
)

CONNECTED = Gauge("kvloop_agent_connected", "1 while the Connect stream to kvloopd is up")
UNACKED = Gauge(
    "kvloop_agent_unacked_batches",
    "Event batches sent to kvloopd and not yet acknowledged (the directory's lag behind the engine)",
)

_ROLES = {"prefill": 1, "decode": 2, "both": 3}


def worker_registration(settings) -> pb.WorkerRegistration:
    """What the agent registers its worker as: the settings, a fresh epoch, this process's pid."""
    from kvloop.common import block_hash
    from kvloop.v1 import directory_pb2 as pb

    return pb.WorkerRegistration(
        worker_id=settings.worker_id,
        role=_ROLES[settings.role],
        model=settings.model,
        engine_id=settings.registered_engine_id(),
        nixl_endpoint=settings.nixl_endpoint,
        host_engine_id=settings.registered_host_engine_id(),
        host_nixl_endpoint=settings.host_nixl_endpoint,
        http_endpoint=settings.http_endpoint,
        block_size=settings.block_size,
        hash_algorithm=settings.hash_algorithm,
        hash_length=settings.hash_length,
        hash_seed=settings.hash_seed
        if settings.hash_seed is not None
        else os.environ.get("PYTHONHASHSEED", block_hash.DEFAULT_SEED),
        kv_bytes_per_block=settings.kv_bytes_per_block,
        kv_dtype=settings.kv_dtype,
        parallel=pb.ParallelLayout(tensor_parallel_size=settings.tensor_parallel_size),
        kv_group_windows=settings.kv_group_windows,
        epoch=random.getrandbits(63) | 1,
        labels={"agent_pid": str(os.getpid())},
        agent_version=VERSION,
    )


def agent_status(settings, link, pump) -> tuple[bool, dict]:
    """``/healthz``: whether the stream to kvloopd is up, and the agent's state."""
    connected = link.connected.is_set()
    return connected, {
        "worker_id": settings.worker_id,
        "connected": connected,
        "epoch": pump.registration.epoch,
        "sequence": link.sequence,
        "acked": link.acked,
        "engine_batches": pump.subscriber.messages,
        "engine_gaps": pump.subscriber.unrecoverable_gaps,
        "retained_runs": len(pump.mirror.retained),
        "engine": pump.engine.state,
        "engine_restarts": pump.engine.restarts,
        "last_error": link.last_error,
        "drained": link.drain_reason,
    }


async def run_agent(settings, stop: asyncio.Event, health_tls: ssl.SSLContext | None = None) -> int:
    from kvloop.agents.sidecar.engine_watch import EngineIncarnation, health_url, watch_health
    from kvloop.agents.sidecar.event_pump import EventPump
    from kvloop.agents.sidecar.health import serve_health
    from kvloop.agents.sidecar.kv_events import KvEventSubscriber
    from kvloop.agents.sidecar.link import DirectoryLink, RegistrationRefused
    from kvloop.agents.sidecar.mirror import WorkerMirror
    from kvloop.clients.directory_client import AsyncDirectoryClient

    mirror = WorkerMirror(settings.hash_length, host_pool=bool(settings.host_nixl_endpoint))
    registration = worker_registration(settings)
    publish_build_info("kvloop-agent")
    client = AsyncDirectoryClient(settings.daemon, settings.security())
    link = DirectoryLink(
        client,
        registration,
        snapshot=mirror.snapshot,
        on_drain=lambda reason: log.warning("worker drained by kvloopd", reason=reason),
    )
    UNACKED.set_function(lambda: link.sequence - link.acked)
    subscriber = KvEventSubscriber(settings.kv_events, settings.kv_events_replay, settings.kv_events_topic)
    started = time.monotonic()
    engine = EngineIncarnation()
    pump = EventPump(subscriber, mirror, link, registration, engine)

    status = functools.partial(agent_status, settings, link, pump)

    health = None
    if settings.health_listen:
        host, port = parse_host_port(settings.health_listen, "health_listen")
        health = serve_health(host, port, status, health_tls)

    async def track_connection() -> None:
        while True:
            await link.connected.wait()
            CONNECTED.set(1)
            while link.connected.is_set():
                await asyncio.sleep(0.5)
            CONNECTED.set(0)

    log.info(
        "kvloop-agent starting",
        worker_id=settings.worker_id,
        model=settings.model,
        daemon=settings.daemon,
        kv_events=settings.kv_events,
        epoch=registration.epoch,
    )
    # These run for the agent's whole life: the first to end (or SIGTERM) ends the agent.
    named = {"directory link": link.run(), "event pump": pump.run(), "connection tracker": track_connection()}
    engine_health = health_url(settings.http_endpoint) if settings.engine_health_interval_s else None
    if engine_health is not None:
        named["engine health watch"] = watch_health(
            engine_health,
            settings.engine_health_interval_s,
            settings.engine_down_after_s,
            on_up=engine.mark_up,
            on_down=pump.engine_down,
        )
    tasks = [asyncio.create_task(coro, name=name) for name, coro in named.items()]
    warner = asyncio.create_task(pump.warn_if_silent(settings.silent_engine_warning_s, settings.kv_events))
    stopper = asyncio.create_task(stop.wait())
    # systemd (Type=notify): ready once /healthz serves and the tasks run (whether kvloopd answers
    # is /healthz's business: an agent waiting for kvloopd is started, not failed); the watchdog is
    # pinged from this loop.
    notifier = Notifier()
    notifier.ready(f"worker {settings.worker_id}, kvloopd at {settings.daemon}")
    pinging = notifier.start_watchdog()
    try:
        done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            failure = task.exception() if task is not stopper else None
            if failure is not None:
                if isinstance(failure, RegistrationRefused):
                    log.error("kvloopd refused this agent", error=str(failure))
                    return 2
                raise failure
            if task is not stopper:
                log.error("agent task ended unexpectedly", task=task.get_name())
                return 1
        # Graceful stop: let acknowledged-so-far settle briefly, then close the stream.
        try:
            await link.wait_acked(timeout=2)
        except TimeoutError:
            log.warning("stopping with unacknowledged batches", sequence=link.sequence, acked=link.acked)
        return 0
    finally:
        notifier.stopping()
        for task in [*tasks, warner, stopper, pinging]:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        if health is not None:
            health.shutdown()
        notifier.close()
        log.info(
            "kvloop-agent stopped",
            worker_id=settings.worker_id,
            uptime_s=round(time.monotonic() - started, 1),
        )


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_line("kvloop-agent"))
        raise typer.Exit()


@app.command()
def run(
    config: Annotated[
        Optional[Path], typer.Option("--config", "-c", help="TOML file (env KVLOOP_AGENT_CONFIG)")
    ] = None,
    daemon: Annotated[Optional[str], typer.Option(help="kvloopd HOST:PORT (env KVLOOP_AGENT_DAEMON)")] = None,
    worker_id: Annotated[Optional[str], typer.Option(help="this vLLM instance's stable name")] = None,
    role: Annotated[Optional[str], typer.Option(help="prefill, decode or both")] = None,
    model: Annotated[Optional[str], typer.Option(help="served model name")] = None,
    engine_id: Annotated[Optional[str], typer.Option(help="vLLM kv_transfer_config engine_id")] = None,
    nixl_endpoint: Annotated[Optional[str], typer.Option(help="NIXL side channel HOST:PORT")] = None,
    host_engine_id: Annotated[
        Optional[str], typer.Option(help="the host-memory pool's NIXL engine id (default: ENGINE_ID@host)")
    ] = None,
    host_nixl_endpoint: Annotated[
        Optional[str], typer.Option(help="the host-memory pool's NIXL side channel HOST:PORT")
    ] = None,
    http_endpoint: Annotated[Optional[str], typer.Option(help="the engine's OpenAI HTTP base URL")] = None,
    block_size: Annotated[Optional[int], typer.Option(help="vLLM block size")] = None,
    hash_seed: Annotated[
        Optional[str], typer.Option(help="the engine's PYTHONHASHSEED (default: this process's)")
    ] = None,
    kv_bytes_per_block: Annotated[Optional[int], typer.Option(help="KV bytes per block, all layers")] = None,
    kv_dtype: Annotated[Optional[str], typer.Option(help="KV-cache element type, e.g. bfloat16")] = None,
    tensor_parallel_size: Annotated[Optional[int], typer.Option(help="the engine's TP size")] = None,
    kv_group_windows: Annotated[
        Optional[str],
        typer.Option(help="sliding window per KV-cache group, comma-separated, 0 = full attention"),
    ] = None,
    kv_events: Annotated[Optional[str], typer.Option(help="vLLM KV-event PUB endpoint")] = None,
    kv_events_replay: Annotated[Optional[str], typer.Option(help="vLLM KV-event replay endpoint")] = None,
    health_listen: Annotated[
        Optional[str], typer.Option(help="/healthz and /metrics HOST:PORT, '' disables")
    ] = None,
    health_cert_file: Annotated[
        Optional[Path], typer.Option(help="serve /healthz and /metrics over HTTPS")
    ] = None,
    health_key_file: Annotated[Optional[Path], typer.Option(help="key of --health-cert-file")] = None,
    health_client_ca_file: Annotated[
        Optional[Path], typer.Option(help="require client certificates signed by this CA (mutual TLS)")
    ] = None,
    log_level: Annotated[Optional[str], typer.Option(help="debug, info, warning, error")] = None,
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="print the version and exit"),
    ] = False,
) -> None:
    if config is not None:
        os.environ["KVLOOP_AGENT_CONFIG"] = str(config)
    flags: dict[str, object] = dict(
        daemon=daemon,
        worker_id=worker_id,
        role=role,
        model=model,
        engine_id=engine_id,
        nixl_endpoint=nixl_endpoint,
        host_engine_id=host_engine_id,
        host_nixl_endpoint=host_nixl_endpoint,
        http_endpoint=http_endpoint,
        block_size=block_size,
        hash_seed=hash_seed,
        kv_bytes_per_block=kv_bytes_per_block,
        kv_dtype=kv_dtype,
        tensor_parallel_size=tensor_parallel_size,
        kv_group_windows=[int(w) for w in kv_group_windows.split(",") if w.strip()]
        if kv_group_windows is not None
        else None,
        kv_events=kv_events,
        kv_events_replay=kv_events_replay,
        health_listen=health_listen,
        log_level=log_level,
    )
    if health_cert_file or health_key_file or health_client_ca_file:
        tls = {
            "cert_file": health_cert_file,
            "key_file": health_key_file,
            "client_ca_file": health_client_ca_file,
        }
        flags["health_tls"] = {k: v for k, v in tls.items() if v is not None}
    settings = _load_settings({k: v for k, v in flags.items() if v is not None})
    health_tls = _health_tls_context(settings)
    configure_logging(settings.log_level, settings.log_json)
    raise typer.Exit(asyncio.run(_run_until_signalled(settings, health_tls)))


def _load_settings(given: dict[str, object]) -> AgentSettings:
    """The settings from ``given`` flags, the environment and the TOML file; on a configuration
    error, each problem on stderr, naming where the bad value came from, and exit status 2."""
    from kvloop.agents.sidecar.config import AgentSettings

    try:
        return AgentSettings(**given)
    except ValidationError as exc:
        path = os.environ.get("KVLOOP_AGENT_CONFIG")

        def origin(key: str) -> str:
            if key in given:
                return "--" + key.replace("_", "-")
            if f"KVLOOP_AGENT_{key.upper()}" in os.environ:
                return f"environment KVLOOP_AGENT_{key.upper()}"
            return path or "settings"

        for line in error_lines(exc, origin):
            typer.echo(f"kvloop-agent: {line}", err=True)
        raise typer.Exit(2) from None
    except FileNotFoundError as exc:  # the TOML file named
        typer.echo(f"kvloop-agent: {exc}", err=True)
        raise typer.Exit(2) from None
    except ValueError as exc:  # the TOML file's syntax
        typer.echo(
            f"kvloop-agent: {os.environ.get('KVLOOP_AGENT_CONFIG')}: TOML syntax error: {exc}", err=True
        )
        raise typer.Exit(2) from None


def _health_tls_context(settings: AgentSettings) -> ssl.SSLContext | None:
    try:  # before anything starts: bad TLS files are a configuration error
        return settings.health_tls.http_server_context() if settings.health_tls else None
    except ValueError as exc:
        typer.echo(f"kvloop-agent: health endpoint: {exc}", err=True)
        raise typer.Exit(2) from None


async def _run_until_signalled(settings: AgentSettings, health_tls: ssl.SSLContext | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return await run_agent(settings, stop, health_tls)


def main() -> None:
    app(prog_name="kvloop-agent")


if __name__ == "__main__":
    main()
