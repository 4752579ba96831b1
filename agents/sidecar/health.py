"""The agent's own /healthz (JSON, 200 when streaming to kvloopd, else 503) and /metrics,
over HTTPS (and mutual TLS) when given an SSL context."""

from __future__ import annotations

import json
import socket
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = structlog.get_logger("kvloop.agent")


def serve_health(
    host: str, port: int, status: Callable[[], tuple[bool, dict]], tls: ssl.SSLContext | None = None
) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                body, code, ctype = generate_latest(), 200, CONTENT_TYPE_LATEST
            elif self.path in ("/healthz", "/health"):
                healthy, detail = status()
                body, code, ctype = json.dumps(detail).encode(), 200 if healthy else 503, "application/json"
            else:
                body, code, ctype = b"not found\n", 404, "text/plain"
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            return

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def finish_request(self, request: socket.socket, client_address) -> None:  # type: ignore[override]
            if tls is None:
                super().finish_request(request, client_address)
                return
            # The TLS handshake runs here, in the connection's own thread, so a stalled or
            # plaintext client never holds up the accept loop.
            request.settimeout(10)
            try:
                secured = tls.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError) as exc:
                log.info("health endpoint: TLS handshake refused", client=client_address[0], error=str(exc))
                return
            try:
                super().finish_request(secured, client_address)
            finally:
                secured.close()

    server = Server((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="kvloop-agent-health", daemon=True).start()
    return server
