"""`kvloopd`: the block-directory daemon's command line."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Optional

import typer
from pydantic import ValidationError

from kvloop.common.logging import configure_logging

app = typer.Typer(add_completion=False, help="kvloop block-directory daemon.")


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
        bool, typer.Option("--check-config", help="validate the configuration, print it and exit")
    ] = False,
) -> None:
    from kvloop.daemon.config import load_settings

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
    except (ValidationError, FileNotFoundError, ValueError) as exc:
        typer.echo(f"kvloopd: invalid configuration:\n{exc}", err=True)
        raise typer.Exit(2) from None
    if check_config:
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


def main() -> None:
    app(prog_name="kvloopd")


if __name__ == "__main__":
    main()
