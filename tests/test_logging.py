"""Logging survives the stream it was configured with being swapped and closed."""

from __future__ import annotations

import io
import logging
import sys

import structlog

from kvloop.common.logging import configure_logging


def test_log_lines_follow_the_current_stderr_after_the_old_one_is_closed(monkeypatch):
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("info", json_logs=True)
    log = structlog.get_logger("kvloop.test")
    log.info("before")
    first.close()  # e.g. a CLI runner's captured stream, closed once the command returned
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    log.warning("after", n=1)  # raised "I/O operation on closed file" and broke a sidecar's reconnect loop
    logging.getLogger("grpc").warning("stdlib too")
    lines = second.getvalue()
    assert '"event": "after"' in lines and '"n": 1' in lines and "stdlib too" in lines
