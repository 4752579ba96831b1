"""What the `kvloop` commands share: the consoles, the global options (`state`), `--json`, calling
kvloopd and printing its answers, and the exit codes scripts can rely on."""

from __future__ import annotations

import json
import sys
from enum import IntEnum
from typing import Annotated, Any, NoReturn

import grpc
import typer
from google.protobuf.descriptor import Descriptor, FieldDescriptor
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


class ExitCode(IntEnum):
    """`kvloop`'s exit statuses (docs/operations.md, "The kvloop CLI in scripts")."""

    OK = 0
    FAILURE = 1  # anything not below (a failed benchmark, an unreadable file, an internal error)
    USAGE = 2  # bad arguments, options or configuration
    UNREACHABLE = 3  # kvloopd did not answer (gRPC UNAVAILABLE or DEADLINE_EXCEEDED)
    NOT_FOUND = 4  # kvloopd answered NOT_FOUND (e.g. draining a worker it does not know)
    REFUSED = 5  # kvloopd refused the caller (UNAUTHENTICATED, PERMISSION_DENIED)


_STATUS_EXIT = {
    grpc.StatusCode.UNAVAILABLE: ExitCode.UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: ExitCode.UNREACHABLE,
    grpc.StatusCode.NOT_FOUND: ExitCode.NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED: ExitCode.REFUSED,
    grpc.StatusCode.PERMISSION_DENIED: ExitCode.REFUSED,
}


def emit_error(message: str, code: int, status: str | None = None) -> None:
    """An error as --json promises it (one JSON object on stdout), or a red line on stderr."""
    if state.json:
        error: dict[str, Any] = {"message": message, "exit_code": int(code)}
        if status is not None:
            error["status"] = status
        sys.stdout.write(json.dumps({"error": error}, sort_keys=True) + "\n")
        sys.stdout.flush()
    else:
        err_console.print(f"[red]kvloop:[/red] {message}", highlight=False)


def _fail(message: str, code: int = ExitCode.FAILURE) -> NoReturn:
    emit_error(message, code)
    raise typer.Exit(int(code))


def fail_rpc(exc: KvloopError) -> NoReturn:
    """kvloopd's error: its gRPC status and message, and the exit code the status maps to."""
    code = _STATUS_EXIT.get(exc.code, ExitCode.FAILURE)
    emit_error(str(exc), code, exc.code.name)
    raise typer.Exit(int(code))


def _client() -> DirectoryClient:
    return DirectoryClient(state.daemon, state.security, timeout=state.timeout)


def _call(fn):
    try:
        with _client() as client:
            return fn(client)
    except KvloopError as exc:
        fail_rpc(exc)


def _emit_json(value) -> None:
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True) + "\n")


_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def _numbers(descriptor: Descriptor, data: dict) -> dict:
    """Proto3's JSON mapping writes 64-bit integers as strings ("lookups": "2"), for JavaScript's
    sake; a script wants numbers (Python and jq read 64-bit integers exactly)."""
    for field in descriptor.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            inner = entry.fields_by_name["value"]
            if inner.type in _INT64:
                data[field.name] = {k: int(v) for k, v in value.items()}
            elif inner.message_type is not None:
                data[field.name] = {k: _numbers(inner.message_type, v) for k, v in value.items()}
        elif entry is not None:
            if isinstance(value, list):
                data[field.name] = [_numbers(entry, v) for v in value]
            else:
                data[field.name] = _numbers(entry, value)
        elif field.type in _INT64:
            data[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
    return data


def _as_dict(message) -> dict:
    data = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return _numbers(message.DESCRIPTOR, data)


def _blank(value: object) -> str:
    return "" if value is None else str(value)
