"""A prefill's kvloop outcome, and the one function that records it.

Every prefill request the connector looks up ends in exactly one :class:`Outcome`, recorded once
by :func:`record`: its ``kvloop.prefill`` span (with the lookup and any READ as children), the
connector's counters, a structured log line, and the ``kvloop_*`` fields returned to the caller
in ``kv_transfer_params`` (the proxy shows them as ``x-kvloop-*`` headers). Path and reason are
the proto's enums, named by :mod:`kvloop.common.outcomes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvloop.agents.connector import telemetry as tm
from kvloop.common.outcomes import path_name, reason_name

if TYPE_CHECKING:
    from opentelemetry.trace import Span


@dataclass
class Outcome:
    path: int  # pb.TurnPath
    reason: int  # pb.DecisionReason
    detail: str = ""
    # Tokens a peer could serve (pulled or not), tokens pulled, local hits, tokens computed here.
    matched_tokens: int = 0
    pulled_tokens: int = 0
    local_tokens: int = 0
    recompute_tokens: int = 0
    bytes: int = 0
    # Bytes pulled per KV-cache group (a sliding-window group moves only its window's blocks).
    group_bytes: list[int] = field(default_factory=list)
    holder: str = ""
    holder_http: str = ""  # the holder's OpenAI endpoint: where the conversation's KV lives
    tier: str = ""  # where the pulled run lives on the holder: "device" or "host" ("" without a pull)
    lookup_ms: float = 0.0
    pull_ms: float | None = None

    def fields(self) -> dict[str, Any]:
        """Flat, JSON-safe fields with the enums as names (spans, logs, kv_transfer_params)."""
        out: dict[str, Any] = {
            "path": path_name(self.path),
            "reason": reason_name(self.reason),
            "detail": self.detail,
            "matched_tokens": self.matched_tokens,
            "pulled_tokens": self.pulled_tokens,
            "local_tokens": self.local_tokens,
            "recompute_tokens": self.recompute_tokens,
            "bytes": self.bytes,
            "group_bytes": list(self.group_bytes),
            "holder": self.holder,
            "holder_http": self.holder_http,
            "tier": self.tier,
            "lookup_ms": round(self.lookup_ms, 3),
        }
        if self.pull_ms is not None:
            out["pull_ms"] = round(self.pull_ms, 3)
        return out


def record(request_id: str, outcome: Outcome, span: Span, end_perf: float) -> dict[str, Any]:
    """Record ``outcome`` everywhere it is seen; returns its ``kv_transfer_params`` fields."""
    fields = outcome.fields()
    span.set_attributes({f"kvloop.{k}": v for k, v in fields.items()})
    span.end(end_time=tm.wall_ns(end_perf))
    tm.REQUESTS.labels(fields["path"], fields["reason"]).inc()
    tm.TOKENS.labels("pulled").inc(outcome.pulled_tokens)
    tm.TOKENS.labels("recomputed").inc(outcome.recompute_tokens)
    tm.TOKENS.labels("local").inc(outcome.local_tokens)
    tm.BYTES.inc(outcome.bytes)
    tm.log.info("kvloop.prefill_path", request_id=request_id, **fields)
    return {f"kvloop_{k}": v for k, v in fields.items()}
