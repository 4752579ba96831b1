"""kvloopd's own span attributes: a Lookup's decision on its request span. The attribute names are a
stable interface (dashboards and `kvloop trace` read them), the same the connector's spans use."""

from __future__ import annotations

from opentelemetry import trace

from kvloop.common.outcomes import decision_name, path_name, reason_name
from kvloop.v1 import directory_pb2 as pb


def annotate_lookup(span: trace.Span, request: pb.LookupRequest, response: pb.LookupResponse) -> None:
    """The turn's decision on kvloopd's Lookup span (attribute names are a stable interface)."""
    if not span.is_recording():
        return
    span.set_attributes(
        {
            "kvloop.model": request.model,
            "kvloop.decision": decision_name(response.decision),
            "kvloop.reason": reason_name(response.reason),
            "kvloop.path": path_name(response.path),
            "kvloop.matched_blocks": response.matched_blocks,
            "kvloop.matched_tokens": response.matched_tokens,
            "kvloop.recompute_tokens": response.recompute_tokens,
            "kvloop.holder": response.holder.worker_id,
            "kvloop.requester": request.requester_worker_id,
            "kvloop.lookup_us": response.lookup_us,
            "kvloop.directory_epoch": response.directory_epoch,
        }
    )
    if response.HasField("cost"):
        span.set_attributes(
            {
                "kvloop.estimated_transfer_ms": response.cost.transfer_ms,
                "kvloop.estimated_recompute_ms": response.cost.recompute_ms,
                "kvloop.detail": response.detail,
            }
        )
