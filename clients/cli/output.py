"""What the `kvloop` commands share: the consoles, the global options (`state`), `--json`, calling
kvloopd and printing its answers."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from google.protobuf.json_format import MessageToDict

from kvloop.clients.console import make_console
from kvloop.clients.directory_client import DirectoryClient, KvloopError
from kvloop.common.security import ClientSecurity

console = make_console()
err_console = make_console(stderr=True)


class _State:
    daemon: str = ""
    security: ClientSecurity = ClientSecurity()
    json: bool = False
    timeout: float = 5.0


state = _State()


def _json_flag(value: bool) -> bool:
    if value:
        state.json = True
    return value


# `--json` is accepted before the subcommand (`kvloop --json workers`) and after it (`kvloop workers
# --json`), and means the same everywhere: print JSON on stdout. Every command takes it.
JsonFlag = Annotated[
    bool,
    typer.Option(
        "--json", callback=_json_flag, help="print JSON on stdout (same as `kvloop --json COMMAND`)"
    ),
]


def _fail(message: str, code: int = 1) -> None:
    err_console.print(f"[red]kvloop:[/red] {message}", highlight=False)
    raise typer.Exit(code)


def _client() -> DirectoryClient:
    return DirectoryClient(state.daemon, state.security, timeout=state.timeout)


def _call(fn):
    try:
        with _client() as client:
            return fn(client)
    except KvloopError as exc:
        _fail(str(exc))


def _emit_json(value) -> None:
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True) + "\n")


def _as_dict(message) -> dict:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _blank(value: object) -> str:
    return "" if value is None else str(value)
