"""`kvloop proxy`: the OpenAI-compatible front over vLLM prefill and decode servers (kvloop.clients.proxy)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from kvloop.clients.cli.output import JsonFlag, _fail, state
from kvloop.common.logging import configure_logging

if TYPE_CHECKING:
    import ssl

    from kvloop.clients.proxy.app import ProxyConfig
    from kvloop.common.security import ClientSecurity

_Route = Annotated[
    bool,
    typer.Option(
        "--route/--no-route",
        help="choose each prefill by kvloopd's Route ranking (kvloopd at --daemon); --no-route: by load",
    ),
]
_RouteBy = Annotated[
    str,
    typer.Option(
        help="with --route: cost (Route's expected TTFT: own prefix, the pull it would add, queue) or "
        "prefix (the prefill whose own cache holds the longest prefix of the prompt, as cache-aware "
        "routers without transfer do; no continuation routes, no burst window)",
    ),
]
_Pull = Annotated[
    bool,
    typer.Option(
        "--pull/--no-pull",
        help="--no-pull: prefills use their own prefix cache only and never pull from a peer "
        "(kv_transfer_params kvloop_pull: false)",
    ),
]
_RouteTimeout = Annotated[
    float, typer.Option(help="seconds for tokenize + Route per request before falling back to load")
]
_Tokenizer = Annotated[
    str,
    typer.Option(
        help="where --route gets token ids: auto (the model's tokenizer, from the model directory the "
        "servers report, when it is on this host), remote (a prefill's /tokenize), or a tokenizer path "
        "or Hugging Face id"
    ),
]
_MaxAttempts = Annotated[
    int,
    typer.Option(
        min=1,
        help="runs of a request on different servers when one fails under it (continuations of a "
        "broken stream included)",
    ),
]
_ContinuationTtl = Annotated[
    float,
    typer.Option(
        min=0,
        help="with --route: seconds to keep Route's answer for a conversation whose streamed turn "
        "ended, to route its next turn without tokenizing or asking Route (0: off)",
    ),
]
_BurstWindow = Annotated[
    float,
    typer.Option(
        "--burst-window-ms",
        min=0,
        help="with --route: a request that would leave the prefill holding the longest prefix of its "
        "prompt waits this long for the rest of its burst, then they are placed together (0: off)",
    ),
]
_ClientCaFile = Annotated[
    Optional[Path], typer.Option(help="require client certificates signed by this CA (mutual TLS)")
]
_ApiKey = Annotated[
    Optional[list[str]],
    typer.Option(
        envvar="KVLOOP_PROXY_API_KEY",
        show_envvar=True,
        help="require `Authorization: Bearer KEY` on /v1/* as `vllm serve --api-key` does (repeatable: "
        "any of them); prefer the environment variable, which other users cannot read from the "
        "process list",
    ),
]
_ApiKeyFile = Annotated[
    Optional[Path],
    typer.Option(
        envvar="KVLOOP_PROXY_API_KEY_FILE",
        show_envvar=True,
        help="clients' keys, one a line, added to --api-key (a systemd credential: %d/api-keys)",
    ),
]
_ServerApiKey = Annotated[
    str,
    typer.Option(
        envvar="KVLOOP_SERVER_API_KEY",
        show_envvar=True,
        help="the key every prefill and decode server was started with (`vllm serve --api-key`)",
    ),
]
_ServerApiKeyFile = Annotated[
    Optional[Path],
    typer.Option(
        envvar="KVLOOP_SERVER_API_KEY_FILE",
        show_envvar=True,
        help="--server-api-key read from this file",
    ),
]
_PrefillApiKey = Annotated[
    str, typer.Option(envvar="KVLOOP_PREFILL_API_KEY", show_envvar=True, help="the prefill servers' key")
]
_DecodeApiKey = Annotated[
    str, typer.Option(envvar="KVLOOP_DECODE_API_KEY", show_envvar=True, help="the decode servers' key")
]


def proxy(
    prefill: Annotated[list[str], typer.Option(help="prefill vLLM server base URL (repeatable)")],
    decode: Annotated[list[str], typer.Option(help="decode vLLM server base URL (repeatable)")],
    listen: Annotated[str, typer.Option(help="HOST:PORT to serve the OpenAI API on")] = "127.0.0.1:8000",
    request_timeout: Annotated[float, typer.Option(help="seconds per upstream request")] = 600.0,
    route: _Route = False,
    route_by: _RouteBy = "cost",
    pull: _Pull = True,
    route_timeout: _RouteTimeout = 0.1,
    tokenizer: _Tokenizer = "auto",
    max_attempts: _MaxAttempts = 3,
    continuation_ttl: _ContinuationTtl = 120.0,
    burst_window: _BurstWindow = 5.0,
    cert_file: Annotated[Optional[Path], typer.Option(help="serve HTTPS with this certificate")] = None,
    key_file: Annotated[Optional[Path], typer.Option(help="key of --cert-file")] = None,
    client_ca_file: _ClientCaFile = None,
    api_key: _ApiKey = None,
    api_key_file: _ApiKeyFile = None,
    server_api_key: _ServerApiKey = "",
    server_api_key_file: _ServerApiKeyFile = None,
    prefill_api_key: _PrefillApiKey = "",
    decode_api_key: _DecodeApiKey = "",
    json_output: JsonFlag = False,
) -> None:
    """Serve vLLM's OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /tokenize,
    /detokenize) over vLLM prefill and decode servers (--json: log lines as JSON). Stops on SIGTERM,
    SIGINT and SIGHUP."""
    from kvloop.clients.proxy.app import ROUTE_BY, ProxyConfig
    from kvloop.common.addresses import parse_host_port
    from kvloop.common.tracing import configure_tracing

    if route_by not in ROUTE_BY:
        _fail(f"--route-by {route_by!r}: choose from {', '.join(ROUTE_BY)}", code=2)
    try:
        host, port = parse_host_port(listen, "listen")
    except ValueError as exc:
        _fail(str(exc), code=2)
    tls = _tls_context(cert_file, key_file, client_ca_file)
    keys = _client_api_keys(api_key, api_key_file)
    server_api_key = _server_api_key(server_api_key, server_api_key_file)
    directory_security = _directory_security()
    configure_logging("info", json_logs=True if state.json else None)
    configure_tracing("kvloop-proxy")
    config = ProxyConfig(
        prefill=prefill,
        decode=decode,
        request_timeout_s=request_timeout,
        directory=state.daemon if route else None,
        directory_security=directory_security,
        route_timeout_s=route_timeout,
        tokenizer=tokenizer,
        max_attempts=max_attempts,
        continuation_ttl_s=continuation_ttl,
        burst_window_s=burst_window / 1e3,
        route_by=route_by,
        pull=pull,
        api_keys=keys,
        prefill_api_key=prefill_api_key or server_api_key,
        decode_api_key=decode_api_key or server_api_key,
    )
    _serve_until_stopped(config, listen, host, port, tls)


def _tls_context(
    cert_file: Path | None, key_file: Path | None, client_ca_file: Path | None
) -> ssl.SSLContext | None:
    if not (cert_file or key_file or client_ca_file):
        return None
    from pydantic import ValidationError

    from kvloop.common.config_files import error_lines
    from kvloop.common.security import TlsSettings

    if not (cert_file and key_file):
        _fail("--cert-file and --key-file go together (--client-ca-file adds mutual TLS)", code=2)
    try:
        settings = TlsSettings(cert_file=cert_file, key_file=key_file, client_ca_file=client_ca_file)
        context = settings.http_server_context()
    except ValidationError as exc:
        _fail("; ".join(error_lines(exc, lambda key: "--" + key.replace("_", "-"))), code=2)
    except ValueError as exc:
        _fail(str(exc), code=2)
    return context


def _client_api_keys(api_key: list[str] | None, api_key_file: Path | None) -> list[str]:
    from kvloop.common.config_files import read_secret

    keys = [k for k in api_key or [] if k]
    if api_key_file is not None:
        try:
            keys += [line.strip() for line in read_secret(api_key_file).splitlines() if line.strip()]
        except ValueError as exc:
            _fail(str(exc), code=2)
    return keys


def _server_api_key(server_api_key: str, server_api_key_file: Path | None) -> str:
    from kvloop.common.config_files import read_secret

    if server_api_key_file is None:
        return server_api_key
    if server_api_key:
        _fail("give --server-api-key or --server-api-key-file, not both", code=2)
    try:
        server_api_key = read_secret(server_api_key_file)
    except ValueError as exc:
        _fail(str(exc), code=2)
    return server_api_key


def _directory_security() -> ClientSecurity:
    """The directory client's token and TLS: the global flags, each falling back to its KVLOOP_* variable."""
    from kvloop.common.security import ClientSecurity

    env, flags = ClientSecurity.from_env(), state.security
    try:
        security = ClientSecurity(
            token=flags.token or env.token,
            ca_file=flags.ca_file or env.ca_file,
            cert_file=flags.cert_file or env.cert_file,
            key_file=flags.key_file or env.key_file,
        )
    except ValueError as exc:
        _fail(str(exc).splitlines()[-1], code=2)
    return security


def _serve_until_stopped(
    config: ProxyConfig, listen: str, host: str, port: int, tls: ssl.SSLContext | None
) -> None:
    import asyncio
    import signal as signals

    from kvloop.clients.proxy.app import serve
    from kvloop.common.tracing import shutdown_tracing

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signals.SIGTERM, signals.SIGINT, signals.SIGHUP):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, host, port, stop, tls)

    try:
        asyncio.run(run())
    except OSError as exc:
        _fail(f"cannot listen on {listen}: {exc}")
    finally:
        shutdown_tracing()
