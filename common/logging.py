"""structlog setup shared by every kvloop process: JSON lines off a terminal, colours on one."""

from __future__ import annotations

import logging
import sys

import structlog


class _CurrentStderr:
    """Whatever ``sys.stderr`` is when a line is written. A stream captured at configure time may be
    swapped and closed later (a CLI runner capturing output, a test harness), after which every log
    call would raise; a log line must never break the loop that makes it (a sidecar's reconnect)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "info", json_logs: bool | None = None, *, stdlib: bool = True) -> None:
    """Route structlog and stdlib logging (grpc, otel) to stderr in one format.

    ``json_logs=None`` picks JSON when stderr is not a terminal (systemd, CI, pipes). ``stdlib=False``
    configures structlog only: inside another program's process (the connector in vLLM's engine
    core), whose own stdlib logging stays as that program set it up.
    """
    if json_logs is None:
        json_logs = not sys.stderr.isatty()
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
    if not stdlib:
        return
    handler = logging.StreamHandler(_CurrentStderr())
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(numeric, logging.INFO) if numeric < logging.INFO else numeric)
