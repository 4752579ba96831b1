"""Noticing that the engine beside the agent ended, so the directory stops serving its blocks.

A ``kill -9``'d vLLM relaunched on the same ports is a new process: its KV cache holds other data at
the block ids the old one announced, and its NIXL side channel answers a prefill's handshake on the
same port. The agent drops everything the old process published (a new registration epoch with an
empty state) as soon as any of these says the engine ended:

* ``publisher``: the KV-event PUB connection closed, or its seq went back (a new publisher counts from
  0). Milliseconds after the death on one host.
* ``health``: the engine's HTTP ``/health``, once seen answering, failed (refused, reset, an error
  status) for ``engine_down_after_s``. A probe that times out proves nothing (a busy engine on a
  small host answers late) and a /health never seen answering is not trusted (a wrong URL must not
  drop the state of a working engine every second).

What keeps a READ of a dead process's run off its successor (agents/connector/worker.py): a prefill
tags each pull with the holder epoch its run was announced under, never reads a run of an epoch it
has seen replaced, and releases the holder's cached NIXL agent (handshaking again) only when it sees a
new epoch (from its peer warmer or a newer run). The one ordering it relies on: the agent registers
the new epoch before the relaunched engine announces anything and, for a handshake made without any
epoch known yet, before that engine listens on its NIXL side channel - vLLM takes 13-40 s to start
here, the agent reacts in milliseconds (publisher) or about one second (health).
"""

from __future__ import annotations

import asyncio
import http.client
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import structlog
from prometheus_client import Counter, Gauge

log = structlog.get_logger("kvloop.agent.engine")

ENGINE_RESTARTS = Counter(
    "kvloop_agent_engine_restarts_total",
    "Engine processes the agent saw end (their blocks were dropped from the directory), by the signal",
    ["signal"],
)
ENGINE_UP = Gauge("kvloop_agent_engine_up", "1 while the engine's /health answers (or its events flow)")

EngineSignal = Literal["publisher", "health"]


def health_url(http_endpoint: str) -> str | None:
    """vLLM's /health beside its OpenAI base URL (with or without /v1); None when no endpoint is known."""
    base = http_endpoint.strip().rstrip("/")
    if not base:
        return None
    base = base.removesuffix("/v1")
    if "://" not in base:
        base = f"http://{base}"
    return f"{base}/health"


def engine_healthy(url: str, timeout_s: float) -> bool | None:
    """One blocking probe: True on a 2xx answer, False when refused, reset or answered with an error,
    None when it timed out (inconclusive)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return 200 <= response.status < 300
    except urllib.error.HTTPError:
        return False
    except urllib.error.URLError as exc:
        return None if isinstance(exc.reason, TimeoutError) else False
    except TimeoutError:
        return None
    except (OSError, ValueError, http.client.HTTPException):  # refused, reset, not HTTP at all
        return False


@dataclass
class EngineIncarnation:
    """Which engine process the agent's published state belongs to, and how many ended."""

    state: Literal["unknown", "up", "down"] = "unknown"
    restarts: int = 0
    # Engine batches taken since the last reset: an engine that published nothing leaves nothing to drop.
    batches: int = 0
    last_reason: str | None = None

    def batch_taken(self) -> None:
        self.batches += 1
        ENGINE_UP.set(1)

    def mark_up(self) -> None:
        if self.state != "up":
            log.info("engine is up", previous=self.state)
        self.state = "up"
        ENGINE_UP.set(1)

    def mark_down(self, signal: EngineSignal, reason: str) -> bool:
        """Record the engine as gone; True when this ends a process whose blocks must be dropped,
        False for a repeat. /health speaks only for an engine it was seen answering for; the
        publisher for any that published since the last reset."""
        if signal == "health" and self.state != "up":
            return False
        ends = self.state == "up" or self.batches > 0
        self.state = "down"
        ENGINE_UP.set(0)
        if not ends:
            return False
        self.restarts += 1
        self.batches = 0
        self.last_reason = reason
        ENGINE_RESTARTS.labels(signal).inc()
        return True


async def watch_health(
    url: str,
    interval_s: float,
    down_after_s: float,
    on_up: Callable[[], None],
    on_down: Callable[[str], None],
) -> None:
    """Probe ``url`` every ``interval_s`` in a thread (never on the event loop); call ``on_down`` while
    it has failed for ``down_after_s`` and at least two probes, ``on_up`` on each success."""
    failing_since: float | None = None
    failures = 0
    timeout_s = max(2.0, interval_s)
    while True:
        started = time.monotonic()
        healthy = await asyncio.to_thread(engine_healthy, url, timeout_s)
        if healthy is None:
            log.debug("engine /health probe timed out", url=url, timeout_s=timeout_s)
        elif healthy:
            failing_since, failures = None, 0
            on_up()
        else:
            failures += 1
            failing_since = failing_since if failing_since is not None else started
            failed_for = time.monotonic() - failing_since
            if failures >= 2 and failed_for >= down_after_s:
                on_down(f"{url} failing for {failed_for:.1f}s ({failures} probes)")
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
