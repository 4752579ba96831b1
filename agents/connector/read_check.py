"""A pull's READ checked against the holder's digests before the prefill computes on it (prefill
role, worker side).

vLLM pairs each local block with a holder block when it posts the READ (``_read_blocks``); the
worker records that pairing here, and once NIXL reports the READ done, digests the local blocks
(digest.py) and compares each with the digest the holder announced for its partner. Any mismatch
fails the pull the way a failed READ does: vLLM recomputes those tokens, and the scheduler side
records ``verify_failed``. A READ of a layout the check does not cover (block sizes that differ, a
host staging buffer, READs from several holder ranks into one block) is not checked, and says so.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.digest import BlockDigester
from kvloop.agents.connector.metadata import VERIFY_FAILED, VERIFY_PASSED, VERIFY_UNCHECKED, PullCheck
from kvloop.common import block_digests

Pairs = list[list[tuple[int, int]]]  # per group: (local block id, holder block id)


class ReadChecks:
    def __init__(self) -> None:
        self._wanted: dict[str, PullCheck] = {}
        self._pairs: dict[str, tuple[int, Pairs] | None] = {}  # None: not checkable
        self._found: dict[str, str] = {}

    def expect(self, checks: dict[str, PullCheck]) -> None:
        self._wanted.update(checks)

    def wants(self, request_id: str) -> bool:
        return request_id in self._wanted

    def paired(self, request_id: str, remote_rank: int, pairs: Pairs | None) -> None:
        """vLLM posts a READ from holder rank ``remote_rank`` with this pairing (None: a layout the
        check does not cover). A second READ for one request reads several holder ranks into its
        blocks: nothing one rank's digests can check."""
        if request_id in self._pairs:
            self._pairs[request_id] = None
            return
        self._pairs[request_id] = None if pairs is None else (remote_rank, pairs)

    def check(self, request_id: str, digester: BlockDigester | None) -> str | None:
        """Check the request's READ, now done; what was found (VERIFY_*), or None when no check was
        asked for."""
        wanted = self._wanted.pop(request_id, None)
        paired = self._pairs.pop(request_id, None)
        if wanted is None:
            return None
        found = VERIFY_UNCHECKED
        if paired is not None and digester is not None:
            started = time.perf_counter()
            try:
                found = _compare(digester, wanted, *paired)
            except Exception as exc:  # a check that cannot run fails nothing: the pull is unchecked
                tm.log.warning("kvloop.verify_error", request_id=request_id, error=repr(exc))
                found = VERIFY_UNCHECKED
            tm.DIGEST_SECONDS.labels("pulled").observe(time.perf_counter() - started)
        self._found[request_id] = found
        return found

    def forget(self, request_id: str) -> None:
        """The request's READ never ran (declined, failed): no check."""
        self._wanted.pop(request_id, None)
        self._pairs.pop(request_id, None)

    def take_found(self) -> dict[str, str]:
        found, self._found = self._found, {}
        return found


def _compare(digester: BlockDigester, wanted: PullCheck, rank: int, pairs: Pairs) -> str:
    try:
        digests = block_digests.unpack(wanted.digests)
    except ValueError as exc:
        tm.log.warning("kvloop.digests_unreadable", error=str(exc))
        return VERIFY_UNCHECKED
    expected = block_digests.by_block_id(digests, rank, wanted.block_ids, wanted.tail_block_ids)
    if expected is None or len(expected) != len(pairs):
        return VERIFY_UNCHECKED
    for g, group_pairs in enumerate(pairs):
        if not group_pairs:
            continue
        want = [expected[g].get(remote) for _, remote in group_pairs]
        if any(w is None for w in want):
            return VERIFY_UNCHECKED  # a block the announced digests do not cover
        got = digester.group(g, [local for local, _ in group_pairs])
        if got != want:
            bad = [remote for (_, remote), a, b in zip(group_pairs, got, want, strict=True) if a != b]
            tm.log.warning("kvloop.pulled_block_mismatch", group=g, holder_blocks=_head(bad), count=len(bad))
            return VERIFY_FAILED
    return VERIFY_PASSED


def _head(values: Sequence[int], n: int = 8) -> list[int]:
    return list(values[:n])
