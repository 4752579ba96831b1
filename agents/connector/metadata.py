"""What kvloop's scheduler side tells its worker side each step, on top of vLLM's NIXL metadata."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata


class KvloopConnectorMetadata(NixlConnectorMetadata):
    """vLLM's ``NixlConnectorMetadata`` plus kvloop's two per-step additions.

    * ``multi_reader``: retained runs (decode role) the worker keeps until their lease ends
      instead of freeing them after the first READ notice;
    * ``pull_deadlines``: for each pull this step (prefill role), when the holder's lease ends, in
      the scheduler's ``perf_counter`` clock (rebased by the worker like vLLM's ``reqs_to_send``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.multi_reader: set[str] = set()
        self.pull_deadlines: dict[str, float] = {}

    @classmethod
    def extend(
        cls, base: NixlConnectorMetadata, multi_reader: set[str], pull_deadlines: dict[str, float]
    ) -> KvloopConnectorMetadata:
        """The metadata vLLM's scheduler built, with kvloop's fields added."""
        meta = cls()
        meta.__dict__.update(base.__dict__)
        meta.multi_reader = multi_reader
        meta.pull_deadlines = pull_deadlines
        return meta
