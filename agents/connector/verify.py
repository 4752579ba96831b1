"""Which pulls' READs are checked against the holder's digests, and which holders are no longer
read from (prefill role, scheduler side).

The check itself runs in the worker, after the READ and before vLLM hears the KV arrived
(worker.py); this side picks the pulls (``kvloop_verify``: all, off, or a share, taken evenly: every
k-th pull, not a coin toss, so a share of 0.25 checks exactly one pull in four) and hears the results.
A holder whose READ failed its check is not read from again by this engine until it registers anew
(a new registration epoch: its agent re-registers when the engine behind it restarts): the fault
that gave one wrong block may give others.
"""

from __future__ import annotations

from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.directory import HolderInfo
from kvloop.agents.connector.metadata import VERIFY_FAILED, PullCheck


class PullVerifier:
    def __init__(self, share: float) -> None:
        self.share = share
        self._credit = 0.0
        self._failed: dict[str, int] = {}  # holder worker id -> the registration epoch that failed

    def check_for(self, holder: HolderInfo) -> PullCheck | None:
        """What this pull's READ is to be checked against, or None (not sampled; or the holder
        announced no digests for the run: counted as unchecked)."""
        if self.share <= 0.0:
            return None
        self._credit += self.share
        if self._credit < 1.0:
            return None
        self._credit -= 1.0
        if not holder.block_digests:
            tm.VERIFY.labels("no_digests").inc()
            return None
        return PullCheck(holder.block_digests, holder.block_ids, holder.tail_block_ids)

    def refuses(self, holder: HolderInfo) -> str | None:
        """Why this holder's run is not to be read, or None."""
        epoch = self._failed.get(holder.worker_id)
        if epoch is None:
            return None
        if holder.holder_epoch != epoch:
            del self._failed[holder.worker_id]  # registered anew since: read from it again
            return None
        return (
            f"holder {holder.worker_id!r} served a block that failed its digest check; "
            "it is not read from until it registers anew"
        )

    def checked(self, holder: HolderInfo, found: str) -> None:
        """A pull's check ended with ``found`` (metadata.VERIFY_*)."""
        tm.VERIFY.labels(found).inc()
        if found == VERIFY_FAILED:
            self._failed[holder.worker_id] = holder.holder_epoch
            tm.log.error(
                "kvloop.verify_failed",
                holder=holder.worker_id,
                engine_id=holder.engine_id,
                handle=holder.retention_handle,
                tier=holder.tier,
                holder_epoch=holder.holder_epoch,
                detail="a pulled block is not what the holder retained: the turn recomputes",
            )
