"""`kvloop proxy`: the OpenAI-compatible front over vLLM prefill and decode servers (kvloop.clients.proxy)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvloop.clients.cli.output import JsonFlag, _fail, state
from kvloop.common.logging import configure_logging


def proxy(
    prefill: Annotated[list[str], typer.Option(help="prefill vLLM server base URL (repeatable)")],
    decode: Annotated[list[str], typer.Option(help="decode vLLM server base URL (repeatable)")],
    listen: Annotated[str, typer.Option(help="HOST:PORT to serve the OpenAI API on")] = "127.0.0.1:8000",
    request_timeout: Annotated[float, typer.Option(help="seconds per upstream request")] = 600.0,
    route: Annotated[
        bool,
        typer.Option(
            "--route/--no-route",
            help="choose each prefill by kvloopd's Route ranking (kvloopd at --daemon); --no-route: by load",
        ),
    ] = False,
    route_by: Annotated[
        str,
        typer.Option(
            help="with --route: cost (Route's expected TTFT: own prefix, the pull it would add, queue) or "
            "prefix (the prefill whose own cache holds the longest prefix of the prompt, as cache-aware "
            "routers without transfer do; no continuation routes, no burst window)",
        ),
    ] = "cost",
    pull: Annotated[
        bool,
        typer.Option(
            "--pull/--no-pull",
            help="--no-pull: prefills use their own prefix cache only and never pull from a peer "
            "(kv_transfer_params kvloop_pull: false)",
        ),
    ] = True,
    route_timeout: Annotated[
        float, typer.Option(help="seconds for tokenize + Route per request before falling back to load")
    ] = 0.1,
    tokenizer: Annotated[
        str,
        typer.Option(
            help="where --route gets token ids: auto (the model's tokenizer, from the model directory the "
            "servers report, when it is on this host), remote (a prefill's /tokenize), or a tokenizer path "
            "or Hugging Face id"
        ),
    ] = "auto",
    max_attempts: Annotated[
        int,
        typer.Option(
            min=1,
            help="runs of a request on different servers when one fails under it (continuations of a "
            "broken stream included)",
        ),
    ] = 3,
    continuation_ttl: Annotated[
        float,
        typer.Option(
            min=0,
            help="with --route: seconds to keep Route's answer for a conversation whose streamed turn "
            "ended, to route its next turn without tokenizing or asking Route (0: off)",
        ),
    ] = 120.0,
    burst_window: Annotated[
        float,
        typer.Option(
            "--burst-window-ms",
            min=0,
            help="with --route: a request that would leave the prefill holding the longest prefix of its "
            "prompt waits this long for the rest of its burst, then they are placed together (0: off)",
        ),
    ] = 5.0,
    cert_file: Annotated[Optional[Path], typer.Option(help="serve HTTPS with this certificate")] = None,
    key_file: Annotated[Optional[Path], typer.Option(help="key of --cert-file")] = None,
    client_ca_file: Annotated[
        Optional[Path], typer.Option(help="require client certificates signed by this CA (mutual TLS)")
    ] = None,
    api_key: Annotated[
        Optional[list[str]],
        typer.Option(
            envvar="KVLOOP_PROXY_API_KEY",
            show_envvar=True,
            help="require `Authorization: Bearer KEY` on /v1/* as `vllm serve --api-key` does (repeatable: "
            "any of them); prefer the environment variable, which other users cannot read from the "
            "process list",
        ),
    ] = None,
    api_key_file: Annotated[
        Optional[Path],
        typer.Option(
            envvar="KVLOOP_PROXY_API_KEY_FILE",
            show_envvar=True,
            help="clients' keys, one a line, added to --api-key (a systemd credential: %d/api-keys)",
        ),
    ] = None,
    server_api_key: Annotated[
        str,
        typer.Option(
            envvar="KVLOOP_SERVER_API_KEY",
            show_envvar=True,
            help="the key every prefill and decode server was started with (`vllm serve --api-key`)",
        ),
    ] = "",
    server_api_key_file: Annotated[
        Optional[Path],
        typer.Option(
            envvar="KVLOOP_SERVER_API_KEY_FILE",
            show_envvar=True,
            help="--server-api-key read from this file",
        ),
    ] = None,
    prefill_api_key: Annotated[
        str,
        typer.Option(envvar="KVLOOP_PREFILL_API_KEY", show_envvar=True, help="the prefill servers' key"),
    ] = "",
    decode_api_key: Annotated[
        str,
        typer.Option(envvar="KVLOOP_DECODE_API_KEY", show_envvar=True, help="the decode servers' key"),
    ] = "",
    json_output: JsonFlag = False,
) -> None:
    """Serve vLLM's OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /tokenize,
    /detokenize) over vLLM prefill and decode servers (--json: log lines as JSON). Stops on SIGTERM,
    SIGINT and SIGHUP."""
    import asyncio
    import signal as signals

    from pydantic import ValidationError

    from kvloop.clients.proxy.app import ROUTE_BY, ProxyConfig, serve
    from kvloop.common.addresses import parse_host_port
    from kvloop.common.config_files import error_lines, read_secret
    from kvloop.common.security import ClientSecurity, TlsSettings
    from kvloop.common.tracing import configure_tracing, shutdown_tracing

    if route_by not in ROUTE_BY:
        _fail(f"--route-by {route_by!r}: choose from {', '.join(ROUTE_BY)}", code=2)
    try:
        host, port = parse_host_port(listen, "listen")
    except ValueError as exc:
        _fail(str(exc), code=2)
    tls = None
    if cert_file or key_file or client_ca_file:
        if not (cert_file and key_file):
            _fail("--cert-file and --key-file go together (--client-ca-file adds mutual TLS)", code=2)
        try:
            tls = TlsSettings(
                cert_file=cert_file, key_file=key_file, client_ca_file=client_ca_file
            ).http_server_context()
        except ValidationError as exc:
            _fail("; ".join(error_lines(exc, lambda key: "--" + key.replace("_", "-"))), code=2)
        except ValueError as exc:
            _fail(str(exc), code=2)
    keys = [k for k in api_key or [] if k]
    try:
        if api_key_file is not None:
            keys += [line.strip() for line in read_secret(api_key_file).splitlines() if line.strip()]
        if server_api_key_file is not None:
            if server_api_key:
                _fail("give --server-api-key or --server-api-key-file, not both", code=2)
            server_api_key = read_secret(server_api_key_file)
    except ValueError as exc:
        _fail(str(exc), code=2)
    # The directory client's token and TLS: the global flags, each falling back to its KVLOOP_* variable.
    env, flags = ClientSecurity.from_env(), state.security
    try:
        directory_security = ClientSecurity(
            token=flags.token or env.token,
            ca_file=flags.ca_file or env.ca_file,
            cert_file=flags.cert_file or env.cert_file,
            key_file=flags.key_file or env.key_file,
        )
    except ValueError as exc:
        _fail(str(exc).splitlines()[-1], code=2)
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
