"""The agent's own /healthz (JSON, 200 when streaming to kvloopd, else 503) and /metrics."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


def serve_health(host: str, port: int, status: Callable[[], tuple[bool, dict]]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
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

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="kvloop-agent-health", daemon=True).start()
    return server
