"""vLLM 0.33's KV-cache registration generation (sleep and wake re-register a decode's KV cache):
announced with each run, forwarded to vLLM in the pull params, older runs withdrawn by the decode and
never read by a prefill. The engines here run vLLM's CPU build 0.32.0, which has no generation: these
tests select the 0.33 adapter (agents/connector/compat.py) over kvloop's real code; `make vllm-compat`
checks the 0.33 symbols it relies on against 0.33.0's source."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvloop.agents.connector.config import KvloopConfig


class _Finished:
    """The parts of a finished vLLM Request that DecodeSide.announce reads."""

    def __init__(self, rid: str, n_blocks: int, bs: int = 4) -> None:
        self.request_id = rid
        self.block_hashes = [bytes([i]) * 32 for i in range(n_blocks)]
        self.num_computed_tokens = n_blocks * bs
        self.all_token_ids = list(range(n_blocks * bs + 1))
        self.lora_request = None


@pytest.fixture
def on_033(monkeypatch):
    from kvloop.agents.connector import compat

    monkeypatch.setattr(compat, "HAS_REGISTRATION_GENERATION", True)
    return compat


def test_the_adapter_follows_the_installed_release():
    import vllm

    from kvloop.agents.connector import compat
    from kvloop.common.vllm_compat import at_least

    assert compat.HAS_REGISTRATION_GENERATION == at_least(vllm.__version__, "0.33.0")
    assert compat.STRIDED_DESCRIPTORS == at_least(vllm.__version__, "0.33.0")
    if not compat.HAS_REGISTRATION_GENERATION:  # 0.32: nothing is forwarded, nothing read
        params: dict = {}
        compat.forward_generation(params, 5)
        assert params == {}
        assert compat.remote_generation(SimpleNamespace(registration_generation=5)) == 0
        assert compat.registration_generation(SimpleNamespace(_registration_generation=5)) == 0


def test_on_033_the_generation_goes_into_the_params_vllm_reads(on_033):
    params: dict = {}
    on_033.forward_generation(params, 4)
    assert params == {"remote_registration_generation": 4}
    assert on_033.remote_generation(SimpleNamespace(registration_generation=4)) == 4
    assert on_033.registration_generation(SimpleNamespace(_registration_generation=2)) == 2
    from kvloop.agents.connector.prefill import HANDLE_KEYS

    # a lookup that decides not to pull strips it with the rest of the handle
    assert "remote_registration_generation" in HANDLE_KEYS


def test_a_decode_withdraws_its_runs_when_its_registration_generation_rises(on_033):
    from kvloop.agents.connector.decode import DecodeSide
    from kvloop.agents.connector.events import KvloopBlocksRetained, KvloopRetentionReleased

    events: list = []
    generation = [0]
    side = DecodeSide(KvloopConfig(), 4, events.append, num_kv_blocks=100, generation=lambda: generation[0])

    def retain(rid: str, ids: list[int]) -> None:
        side.announce(_Finished(rid, len(ids)), {"remote_block_ids": [ids]}, 60.0, [ids])

    retain("a", [1, 2, 3])
    retain("b", [4, 5])
    assert [e.registration_generation for e in events] == [0, 0]
    assert side.check_generation() == 0 and len(events) == 2  # unchanged: nothing withdrawn

    generation[0] = 1  # the engine slept, woke and registered its KV cache again
    assert side.check_generation() == 1 + 1
    withdrawn = events[2:]
    assert all(isinstance(e, KvloopRetentionReleased) and e.reason == "reregistered" for e in withdrawn)
    assert {e.retention_handle for e in withdrawn} == {"a", "b"}
    assert side.pinned_blocks == 5  # vLLM still holds the blocks until it frees the requests

    retain("c", [6, 7])
    new = events[-1]
    assert isinstance(new, KvloopBlocksRetained) and new.registration_generation == 1
    count = len(events)
    side.released({"a", "b"})  # vLLM frees the withdrawn runs: their release went out already
    assert len(events) == count
    assert side.pinned_blocks == 2
    side.released({"c"})
    assert isinstance(events[-1], KvloopRetentionReleased) and events[-1].retention_handle == "c"
    assert events[-1].reason != "reregistered"


def test_a_prefill_never_reads_a_run_of_an_older_generation_than_it_saw(on_033):
    from kvloop.agents.connector.worker import KvloopConnectorWorker

    worker = SimpleNamespace(_peer_generations={})
    veto = KvloopConnectorWorker._generation_veto
    assert veto(worker, "d0", 0) is None
    assert veto(worker, "d0", 2) is None  # vLLM re-handshakes and loads the new registration
    assert worker._peer_generations == {"d0": 2}
    declined = veto(worker, "d0", 1)
    assert declined is not None and "generation 1; the holder is at 2" in declined
    assert veto(worker, "d1", 0) is None  # per holder engine
    assert veto(worker, "d0", 2) is None


def test_sleep_mode_is_supported_where_vllms_nixl_connector_supports_it():
    """0.33's NixlConnector answers (UCX only) and kvloop follows it; 0.32's has no sleep mode."""
    import vllm

    from kvloop.agents.connector.connector import KvloopConnector
    from kvloop.common.vllm_compat import at_least

    answer = KvloopConnector.supports_sleep_mode(SimpleNamespace(get_from_extra_config=lambda k, d: d))
    assert answer is at_least(vllm.__version__, "0.33.0")


def _host_decode(host_on_reset: str):
    from kvloop.agents.connector.decode import DecodeSide
    from kvloop.agents.connector.host.tier import HostTier

    events: list = []
    host = HostTier(32, 600.0, 2.0, events.append, None)
    cfg = KvloopConfig(host_on_reset=host_on_reset)
    side = DecodeSide(cfg, 4, events.append, num_kv_blocks=100, host=host)

    def retain(rid: str, ids: list[int]) -> None:
        request = _Finished(rid, len(ids))
        request.block_hashes = [rid.encode() * 32 + h for h in request.block_hashes]
        side.announce(request, {"remote_block_ids": [ids]}, 60.0, [ids])

    retain("a", [1, 2, 3])
    side.host_copied({c.handle: True for c in side.take_host_copies()})
    retain("b", [4, 5])  # its copy is still being written when the cache is reset
    side.take_host_copies()
    return side, host, events


def test_a_sleep_withdraws_the_kv_cache_runs_and_keeps_the_host_copies():
    """vLLM resets the connector's cache as a sleep pauses the engine, before the KV cache goes: the
    runs in it leave the directory; the pool (host memory) serves its copies on, and a copy that was
    being written is announced once written (it was read before the KV cache was deregistered)."""
    from kvloop.agents.connector.events import KvloopBlocksRetained, KvloopRetentionReleased

    side, host, events = _host_decode("keep")
    count = len(events)
    side.cache_reset()
    withdrawn = events[count:]
    assert {(e.retention_handle, e.reason) for e in withdrawn if isinstance(e, KvloopRetentionReleased)} == {
        ("a", "reset"),
        ("b", "reset"),
    }
    assert host.has_copy("a")
    side.host_copied({"b@host": True})
    assert isinstance(events[-1], KvloopBlocksRetained) and events[-1].retention_handle == "b@host"
    count = len(events)
    side.released({"a", "b"})  # vLLM frees the withdrawn runs: said once already
    assert len(events) == count and side.pinned_blocks == 0


def test_where_weights_change_in_sleep_the_pool_is_released_too():
    from kvloop.agents.connector.events import KvloopRetentionReleased

    side, host, events = _host_decode("drop")
    count = len(events)
    side.cache_reset()
    released = {
        (e.retention_handle, e.reason) for e in events[count:] if isinstance(e, KvloopRetentionReleased)
    }
    assert released == {("a", "reset"), ("b", "reset"), ("a@host", "reset")}
    side.host_copied({"b@host": True})  # written before the reset: never announced
    assert not host.has_copy("b") and not host.has_copy("a")
    assert host.free_slots == 32 - 3  # a's slots stay fenced until its drop is past its read window


def test_the_connector_passes_a_cache_reset_to_its_scheduler_side():
    from kvloop.agents.connector.connector import KvloopConnector
    from kvloop.agents.connector.scheduler import KvloopConnectorScheduler

    calls: list = []
    scheduler = object.__new__(KvloopConnectorScheduler)
    scheduler.decode = SimpleNamespace(cache_reset=lambda: calls.append("reset"))  # type: ignore[attr-defined]
    connector = object.__new__(KvloopConnector)
    connector.connector_scheduler = scheduler  # type: ignore[attr-defined]
    assert connector.reset_cache() is None  # no failure: vLLM goes on with its reset
    assert calls == ["reset"]
