"""Logging survives the stream it was configured with being swapped and closed."""

from __future__ import annotations

import io
import json
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


def test_structlog_only_leaves_the_host_programs_logging_alone(monkeypatch):
    """The connector configures kvloop's logging inside vLLM's process: structlog filtered and in
    JSON, vLLM's stdlib handlers untouched."""
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    root = logging.getLogger()
    host_handler = logging.NullHandler()
    monkeypatch.setattr(root, "handlers", [host_handler])
    configure_logging("info", json_logs=True, stdlib=False)
    log = structlog.get_logger("kvloop.connector.test")
    log.debug("kvloop.retained", blocks=48)
    log.info("kvloop.scheduler_init", engine_id="e")
    assert root.handlers == [host_handler]
    lines = [json.loads(line) for line in err.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["kvloop.scheduler_init"]
    assert lines[0]["level"] == "info" and lines[0]["engine_id"] == "e"
