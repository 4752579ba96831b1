"""`kvloopd`: the block-directory daemon's command line."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvloop.common.logging import configure_logging

app = typer.Typer(add_completion=False, help="kvloop block-directory daemon.")


def _print_version(value: bool) -> None:
    if value:
        from kvloop.common.version import version_line

        typer.echo(version_line("kvloopd"))
        raise typer.Exit()


@app.command()
def run(
    config: Annotated[
        Optional[Path],
        typer.Option(
            "--config",
            "-c",
            help="TOML file (default /etc/kvloop/kvloopd.toml if present; env KVLOOP_CONFIG)",
        ),
    ] = None,
    listen: Annotated[Optional[str], typer.Option(help="gRPC HOST:PORT (env KVLOOP_LISTEN)")] = None,
    metrics_listen: Annotated[
        Optional[str], typer.Option(help="Prometheus HOST:PORT, '' to disable (env KVLOOP_METRICS_LISTEN)")
    ] = None,
    log_level: Annotated[Optional[str], typer.Option(help="debug, info, warning, error")] = None,
    log_json: Annotated[
        Optional[bool],
        typer.Option(
            "--log-json/--log-console", help="JSON log lines (default: JSON unless stderr is a terminal)"
        ),
    ] = None,
    span_file: Annotated[
        Optional[str], typer.Option(help="also write spans as JSON lines to this file")
    ] = None,
    store: Annotated[
        Optional[str],
        typer.Option(
            help="where the directory lives: 'memory' (default) or redis://HOST:PORT/DB, rediss:// for TLS "
            "(env KVLOOP_STORE__URL; user and password better in the config file's store table)"
        ),
    ] = None,
    check_config: Annotated[
        bool,
        typer.Option(
            "--check-config",
            help="validate the configuration (opening every file it names), print it and exit: "
            "2 when invalid",
        ),
    ] = False,
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="print the version and exit"),
    ] = False,
    connect: Annotated[
        bool,
        typer.Option(
            "--connect", help="with --check-config: also reach the store (Redis, Sentinel); 1 when it fails"
        ),
    ] = False,
) -> None:
    from kvloop.daemon.config import ConfigError, load_settings

    try:
        settings = load_settings(
            config,
            listen=listen,
            metrics_listen=metrics_listen,
            log_level=log_level,
            log_json=log_json,
            span_file=span_file,
            store={"url": store} if store is not None else None,
        )
    except ConfigError as exc:
        for line in exc.lines:
            typer.echo(f"kvloopd: {line}", err=True)
        raise typer.Exit(2) from None
    if check_config:
        for warning in settings.exposure_warnings():
            typer.echo(f"kvloopd: warning: {warning}", err=True)
        if connect:
            _reach_store(settings)
        typer.echo(settings.model_dump_json(indent=2, exclude={"tokens"}))
        return
    configure_logging(settings.log_level, settings.log_json)
    from kvloop.daemon.gc_tuning import tune_gc
    from kvloop.daemon.server import DaemonStartError, serve

    tune_gc(settings.gc_young_threshold)  # after the imports: what is alive now lives for good
    try:
        asyncio.run(serve(settings))
    except DaemonStartError as exc:
        typer.echo(f"kvloopd: {exc}", err=True)
        raise typer.Exit(1) from None


def _reach_store(settings) -> None:
    """Connect to the configured store as serving would (functions loaded, Sentinel asked), then
    close: a check that the address, credentials and TLS work."""
    from kvloop.daemon.server import DaemonStartError, open_store

    async def reach() -> str:
        store = await open_store(settings)
        try:
            return store.name
        finally:
            await store.close()

    try:
        name = asyncio.run(reach())
    except DaemonStartError as exc:
        typer.echo(f"kvloopd: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"kvloopd: store reachable ({name})", err=True)


def main() -> None:
    app(prog_name="kvloopd")


if __name__ == "__main__":
    main()
