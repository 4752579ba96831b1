"""Fast checks of the connector's parts that need no engine (some import vLLM's code)."""

from __future__ import annotations

import time

import msgspec
import pytest
from pydantic import ValidationError

from kvloop.agents.connector.config import KvloopConfig
from kvloop.agents.connector.directory import DirectoryLookups, PullerConstraints, holder_from_proto
from kvloop.agents.connector.events import (
    KvloopBlocksRetained,
    KvloopRetentionReleased,
    decode_event_batch,
)


def _run(handle: str, hashes: list[bytes], lease_ms: int = 60_000, single_use: bool = False):
    return KvloopBlocksRetained(
        block_hashes=hashes,
        block_ids=[[100 + i for i in range(len(hashes))]],
        retention_handle=handle,
        lease_ms=lease_ms,
        single_use=single_use,
    )


H = [bytes([i]) * 32 for i in range(10)]


def test_config_from_extra_config():
    cfg = KvloopConfig.from_extra_config(
        {"bidirectional_kv_xfer": True, "kvloop_daemon": "h:1", "kvloop_lookup_timeout_ms": 5}
    )
    assert cfg.daemon == "h:1" and cfg.lookup_timeout_ms == 5 and cfg.sharing == "multi"
    with pytest.raises(ValidationError):
        KvloopConfig.from_extra_config({"kvloop_daemon": "nohostport"})
    with pytest.raises(ValidationError):
        KvloopConfig.from_extra_config({"kvloop_typo": 1})


def test_event_wire_format_matches_vllm_batch():
    # vLLM's KVEventBatch is array-like [ts, events, dp_rank]; events are maps tagged "type".
    batch = [
        1.5,
        [
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"},
            msgspec.to_builtins(_run("r1", H[:2])),
            msgspec.to_builtins(KvloopRetentionReleased(retention_handle="r0")),
        ],
        0,
    ]
    decoded = decode_event_batch(msgspec.msgpack.encode(batch))
    assert decoded.vllm[0]["type"] == "BlockRemoved"
    assert isinstance(decoded.kvloop[0], KvloopBlocksRetained)
    assert decoded.kvloop[0].block_hashes == H[:2]
    assert decoded.kvloop[1].retention_handle == "r0"
    assert msgspec.to_builtins(_run("x", H[:1]))["type"] == "kvloop.retained"


def test_holder_block_ids_are_group_major():
    from kvloop.v1 import directory_pb2 as pb

    h = holder_from_proto(
        pb.Holder(
            engine_id="e",
            nixl_endpoint="10.0.0.1:5601",
            block_ids=[1, 2, 3, 7, 8, 9],
            num_groups=2,
            retention_handle="r",
            expires_in_ms=9000,
            matched_blocks=3,
        )
    )
    assert h.block_ids == ((1, 2, 3), (7, 8, 9)) and h.host == "10.0.0.1" and h.port == 5601
    # an answer whose block lists are shorter than the match is refused, never half-applied
    with pytest.raises(ValueError, match="matched blocks"):
        holder_from_proto(pb.Holder(engine_id="e", nixl_endpoint="h:1", block_ids=[1, 2], matched_blocks=3))


def test_grpc_directory_unreachable_returns_none_fast():
    import time

    constraints = PullerConstraints("m", "p0", 32, 64, 6000, 1, "bfloat16", 1024)
    d = DirectoryLookups("127.0.0.1:9", constraints, timeout_ms=50, backoff_s=5)
    t = time.perf_counter()
    assert d.lookup(H[:2], 0) is None
    assert d.lookup(H[:2], 0) is None  # backoff: no second RPC
    assert time.perf_counter() - t < 1.0
    d.close()


def test_the_connector_refuses_a_vllm_it_was_not_written_for():
    from kvloop.agents.connector.worker import SUPPORTED_VLLM, check_vllm_version

    for release in SUPPORTED_VLLM:
        check_vllm_version(release)
        check_vllm_version(release + "+cpu")
    for other in ("0.31.2", "0.34.0", "1.0.0"):
        with pytest.raises(ImportError, match=r"supports vLLM 0\.32\.0, 0\.33\.0; vLLM .* is installed"):
            check_vllm_version(other)


def test_read_margin_must_be_below_the_lookup_margin():
    with pytest.raises(ValidationError, match="read_margin_s"):
        KvloopConfig.from_extra_config({"kvloop_expiry_margin_s": 1.0, "kvloop_read_margin_s": 2.0})


def test_outcome_fields_name_the_proto_enums():
    from kvloop.agents.connector.outcome import Outcome
    from kvloop.common.outcomes import PATH_NAMES
    from kvloop.v1 import directory_pb2 as pb

    fields = Outcome(pb.TURN_PATH_RECOMPUTE, pb.DECISION_REASON_BELOW_THRESHOLD, matched_tokens=32).fields()
    assert (fields["path"], fields["reason"], fields["matched_tokens"]) == (
        "recompute",
        "below_threshold",
        32,
    )
    assert set(PATH_NAMES) == {"transfer", "recompute", "local", "miss", "expired", "failed"}


class _Request:
    def __init__(self, finished: bool) -> None:
        self.finished = finished

    def is_finished(self) -> bool:
        return self.finished


class _Connector:
    def __init__(self, push: bool = False) -> None:
        self.push = push

    def has_pending_push_work(self) -> bool:
        return self.push


class _Scheduler:
    """The parts of vLLM's Scheduler the idle wait reads."""

    def __init__(self, requests: dict, unfinished: bool = False, finished_ids=(), push: bool = False):
        self.requests = requests
        self.unfinished = unfinished
        self.finished_req_ids = set(finished_ids)
        self.connector = _Connector(push)
        self.ec_connector = None

    def has_unfinished_requests(self) -> bool:
        return self.unfinished


def test_the_engine_rests_only_while_it_holds_nothing_but_parked_runs():
    from kvloop.agents.connector.idle import earliest_lease_end

    parked = {"a": 105.0, "b": 103.0}.get  # request id -> lease end; others are not parked
    held = {"a": _Request(True), "b": _Request(True)}
    assert earliest_lease_end(_Scheduler(held), parked, now=100.0) == 103.0
    assert earliest_lease_end(_Scheduler(held), parked, now=103.0) is None  # b's lease ended: step
    assert earliest_lease_end(_Scheduler(held, unfinished=True), parked, now=100.0) is None
    assert earliest_lease_end(_Scheduler(held, finished_ids={"a"}), parked, now=100.0) is None
    assert earliest_lease_end(_Scheduler(held, push=True), parked, now=100.0) is None
    single_use = {**held, "c": _Request(True)}  # not parked: freed by its READ's notice
    assert earliest_lease_end(_Scheduler(single_use), parked, now=100.0) is None
    running = {**held, "a": _Request(False)}
    assert earliest_lease_end(_Scheduler(running), parked, now=100.0) is None


def test_lease_timer_wakes_once_at_the_last_time_given():
    import time

    from kvloop.agents.connector.idle import LeaseTimer
    from tests.support import wait_until

    woken: list[float] = []
    timer = LeaseTimer(lambda: woken.append(time.perf_counter()))
    at = time.perf_counter() + 0.3
    timer.wake_at(at + 5)
    timer.wake_at(at)  # the loop re-arms with the current earliest lease end
    wait_until(lambda: woken, 5, "the lease timer's wake-up", interval=0.01)
    assert woken[0] >= at and len(woken) == 1


class _Finished:
    """The parts of a finished vLLM Request that DecodeSide.announce reads."""

    def __init__(self, rid: str, n_blocks: int, bs: int = 4) -> None:
        self.request_id = rid
        self.block_hashes = [bytes([i]) * 32 for i in range(n_blocks)]
        self.num_computed_tokens = n_blocks * bs
        self.all_token_ids = list(range(n_blocks * bs + 1))
        self.lora_request = None


def _declined_capped() -> float:
    from kvloop.agents.connector import telemetry as tm

    return tm.LOCAL.get_sample_value("kvloop_connector_retention_declined_total", {"reason": "capped"}) or 0


def test_retention_stays_within_its_share_of_the_kv_cache():
    from kvloop.agents.connector.decode import DecodeSide

    events: list = []
    cfg = KvloopConfig(retention_max_share=0.1)
    side = DecodeSide(cfg, 4, events.append, num_kv_blocks=100)  # at most 10 blocks pinned
    assert side.max_pinned == 10

    def retain(rid: str, groups: list[list[int]]) -> None:
        assert side.admits(groups)
        side.announce(_Finished(rid, len(groups[0])), {"remote_block_ids": groups}, 60.0, groups)

    declined = _declined_capped()
    retain("t1", [[1, 2, 3, 4]])
    # turn 2 of the same conversation: its prefix is turn 1's blocks (vLLM's prefix cache), so
    # only its 4 new blocks count; the null block (0, out of a sliding window) is no block
    retain("t2", [[1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 9, 10]])
    assert side.pinned_blocks == 10 and len(events) == 2
    assert not side.admits([[11]])  # one more block would pass the share
    assert side.admits([[1, 2]])  # already pinned: retaining it again costs nothing
    assert _declined_capped() == declined + 1
    side.released({"t1"})  # t2 still holds every block t1 did
    assert side.pinned_blocks == 10 and not side.admits([[11]])
    side.released({"t2"})
    assert side.pinned_blocks == 0 and side.admits([[11] * 1, list(range(12, 21))])
    assert _declined_capped() == declined + 2


async def test_past_most_of_its_share_retention_gives_up_its_oldest_runs(daemon):
    """With a daemon to confirm drops with (yielding.py), a finishing request that takes retention past
    0.9 of its share makes the oldest runs go: their release is sent at once; they are freed only
    once kvloopd, serving this decode in sync, no longer lists them, a read window (30 s) plus the
    READ margin later."""
    import asyncio

    from kvloop.agents.connector import telemetry as tm
    from kvloop.agents.connector.decode import DecodeSide
    from kvloop.agents.connector.yielding import ReleaseConfirmer
    from kvloop.clients.directory_client import AsyncDirectoryClient
    from tests.support import running_agent, wait_until

    events: list = []
    cfg = KvloopConfig(
        retention_max_share=0.2, daemon=daemon.address, model="m-yield", retention_yield_after_s=0
    )
    confirmer = ReleaseConfirmer(daemon.address, "m-yield", "dec-yield", cfg.read_margin_s)
    side = DecodeSide(cfg, 4, events.append, num_kv_blocks=100, confirmer=confirmer)  # 20 pinned at most

    def retain(rid: str, blocks: list[int]) -> None:
        assert side.admits([blocks])
        side.announce(_Finished(rid, len(blocks)), {"remote_block_ids": [blocks]}, 300.0, [blocks])

    def yielded(outcome: str) -> float:
        return tm.LOCAL.get_sample_value("kvloop_connector_yielded_runs_total", {"outcome": outcome}) or 0

    given_up, confirmed = yielded("given_up"), yielded("confirmed")
    free: dict[str, float] = {}

    def give_up_and_wait_for_confirmation() -> float:
        retain("t1", [1, 2, 3, 4])
        retain("t2", [1, 2, 3, 4, 5, 6, 7, 8])  # the same conversation's next turn: t1's blocks and 4 more
        retain("x", list(range(9, 17)))
        assert side.pinned_blocks == 16 and len(events) == 3  # within 0.9 of the share: nothing given up
        started = time.perf_counter()
        retain("y", list(range(17, 21)))  # 20 > 18: t1 alone frees nothing (t2 holds its blocks), t2 does
        released = [e.retention_handle for e in events[3:] if isinstance(e, KvloopRetentionReleased)]
        assert released == ["t1", "t2"] and yielded("given_up") == given_up + 2
        assert side.parked_until("t1") is None  # the engine steps until the drop is settled
        wait_until(lambda: free.update(side.take_free_early()) or len(free) == 2, 10, "the drops confirmed")
        return started

    async with AsyncDirectoryClient(daemon.address) as client:
        async with running_agent(client, "dec-yield", "m-yield"):  # this decode, registered and in sync
            # (in a thread: the event loop keeps the agent's stream alive meanwhile)
            started = await asyncio.to_thread(give_up_and_wait_for_confirmation)
    assert yielded("confirmed") == confirmed + 2
    for rid in ("t1", "t2"):
        assert started + 32.0 <= free[rid] <= time.perf_counter() + 32.0
        assert side.parked_until(rid) == free[rid]
    assert side.parked_until("x") is not None and side.parked_until("x") > started + 299
    side.released({"t1", "t2"})  # vLLM freed them at the new lease end
    assert side.pinned_blocks == 12
    assert not [e for e in events[5:] if isinstance(e, KvloopRetentionReleased)]  # said once, not twice
    side.shutdown()


def test_retention_gives_up_no_run_retained_more_recently_than_yield_after(daemon):
    """A conversation still going on keeps its latest run young: only older runs are given up."""
    from kvloop.agents.connector.decode import DecodeSide
    from kvloop.agents.connector.yielding import ReleaseConfirmer

    events: list = []
    cfg = KvloopConfig(retention_max_share=0.1, daemon=daemon.address, model="m-young")
    assert cfg.retention_yield_after_s == 60
    confirmer = ReleaseConfirmer(daemon.address, "m-young", "dec-young", cfg.read_margin_s)
    side = DecodeSide(cfg, 4, events.append, num_kv_blocks=100, confirmer=confirmer)  # 10 at most
    blocks = list(range(1, 10))
    assert side.admits([blocks])
    side.announce(_Finished("a", 9), {"remote_block_ids": [blocks]}, 300.0, [blocks])
    assert not side.admits([[10, 11]])  # past the share: declined, and "a" (seconds old) is kept
    assert len(events) == 1 and side.parked_until("a") is not None


def test_without_a_daemon_retention_never_gives_up_a_run():
    from kvloop.agents.connector.decode import DecodeSide

    events: list = []
    side = DecodeSide(KvloopConfig(retention_max_share=0.1), 4, events.append, num_kv_blocks=100)
    side.admits([[1, 2, 3, 4, 5, 6, 7, 8, 9]])
    side.announce(_Finished("a", 9), {"remote_block_ids": [list(range(1, 10))]}, 60.0, [list(range(1, 10))])
    assert side.admits([[10]]) and not side.admits([[11, 12]])  # past 0.9, past the share: no give-up
    assert len(events) == 1 and side.take_free_early() == {}


def test_retention_share_must_be_a_share():
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValidationError):
            KvloopConfig.from_extra_config({"kvloop_retention_max_share": bad})
    assert KvloopConfig.from_extra_config({"kvloop_retention_max_share": 1}).retention_max_share == 1


@pytest.mark.parametrize("mode", ["kvloop", "builtin"])
def test_the_engine_launcher_passes_settings_the_connector_accepts(mode):
    from kvloop.agents.engine import EngineConfig

    launcher = EngineConfig(
        role="decode",
        model="m",
        served_model_name="m",
        worker_id="decode-0",
        port=1,
        nixl_port=2,
        kv_events_port=3,
        daemon="127.0.0.1:50051",
        mode=mode,
    )
    cfg = KvloopConfig.from_extra_config(launcher.kv_transfer_config()["kv_connector_extra_config"])
    # vLLM's own reverse mode (builtin) retains without bound; kvloop caps retention at half the cache
    assert cfg.retention_max_share == (1.0 if mode == "builtin" else 0.5)
    assert cfg.retention_ttl_s == launcher.retention_ttl_s
