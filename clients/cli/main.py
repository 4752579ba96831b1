"""`kvloop`: inspect and exercise a kvloopd directory (human tables, or --json for scripts).

The Typer app and its global options. Each command lives in a module of its own (`ops`, `proxy`,
`engine`, `demo`, `bench_*`) and is registered here, in the order `kvloop --help` lists them; those
modules import benchmarks, the proxy, the fleet and vLLM only inside the command that needs them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvloop.clients.cli import (
    bench_daemon,
    bench_decode,
    bench_faults,
    bench_gpu,
    bench_multiturn,
    bench_replay,
    demo,
    doctor,
    engine,
    ops,
    proxy,
)
from kvloop.clients.cli.output import ExitCode, _fail, emit_error, state
from kvloop.clients.directory_client import default_target
from kvloop.common.logging import configure_logging
from kvloop.common.security import ClientSecurity

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Inspect and exercise the kvloop block directory (kvloopd).",
)
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print figures.")
app.add_typer(bench_app, name="bench")


def _print_version(value: bool) -> None:
    if value:
        from kvloop.common.version import version_line

        typer.echo(version_line("kvloop"))
        raise typer.Exit()


@app.callback()
def _global(
    daemon: Annotated[str, typer.Option(envvar="KVLOOP_DAEMON", help="kvloopd HOST:PORT")] = default_target(),
    token: Annotated[Optional[str], typer.Option(envvar="KVLOOP_TOKEN", help="bearer token")] = None,
    ca_file: Annotated[Optional[Path], typer.Option(help="CA bundle: use TLS")] = None,
    cert_file: Annotated[Optional[Path], typer.Option(help="client certificate (mutual TLS)")] = None,
    key_file: Annotated[Optional[Path], typer.Option(help="client key (mutual TLS)")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="print JSON instead of tables")] = False,
    timeout: Annotated[float, typer.Option(help="seconds per call")] = 5.0,
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="print the version and exit"),
    ] = False,
) -> None:
    configure_logging("warning")
    state.daemon = daemon
    try:
        state.security = ClientSecurity(token=token, ca_file=ca_file, cert_file=cert_file, key_file=key_file)
    except ValueError as exc:
        _fail(str(exc).splitlines()[-1], code=2)
    state.json = json_output
    state.timeout = timeout


app.command()(ops.workers)
app.command("find")(ops.find)
app.command("blocks", help="Alias of find.")(ops.find)
app.command()(ops.lookup)
app.command()(ops.stats)
app.command()(ops.pairs)
app.command()(ops.watch)
app.command()(ops.drain)
bench_app.command("slow-reads")(bench_faults.bench_slow_reads)
bench_app.command("chaos")(bench_faults.bench_chaos)
bench_app.command("decode-tpot")(bench_decode.bench_decode_tpot)
bench_app.command("directory")(bench_daemon.bench_directory)
bench_app.command("fuzz")(bench_daemon.bench_fuzz)
bench_app.command("soak")(bench_daemon.bench_soak)
bench_app.command("proxy-load")(bench_faults.bench_proxy_load)
bench_app.command("idle")(bench_decode.bench_idle)
bench_app.command("replay")(bench_replay.bench_replay)
app.command()(proxy.proxy)
bench_app.command("multiturn")(bench_multiturn.bench_multiturn)
bench_app.command("multiturn-pool")(bench_multiturn.bench_multiturn_pool)
bench_app.command("gpu")(bench_gpu.bench_gpu)
# `kvloop engine ... -- ARGS`: ARGS go to vllm serve as they are.
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(engine.engine)
app.command()(demo.demo)
app.command("trace")(ops.trace_cmd)
app.command()(doctor.doctor)


def main() -> None:
    """Run `kvloop`. With --json, usage errors (an unknown option, a missing argument) are JSON like
    every other error; without it, click prints them. Exit statuses: output.ExitCode."""
    import sys

    if "--json" not in sys.argv[1:]:
        app(prog_name="kvloop")
        return
    try:
        result = app(prog_name="kvloop", standalone_mode=False)
    except Exception as exc:
        # click's usage errors (typer vendors click, so matched by shape rather than by class)
        format_message = getattr(exc, "format_message", None)
        if format_message is None:
            raise
        state.json = True
        code = getattr(exc, "exit_code", ExitCode.USAGE)
        emit_error(format_message(), code)
        sys.exit(code)
    sys.exit(result if isinstance(result, int) else ExitCode.OK)


if __name__ == "__main__":
    main()
