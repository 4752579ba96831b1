"""kvloop-agent settings for the worker's host-memory pool: flags, environment and config file fill
the same registration fields (agents/sidecar/config.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvloop.agents.sidecar.config import AgentSettings


def test_the_host_pool_comes_from_settings_env_or_file_and_its_engine_id_defaults(tmp_path, monkeypatch):
    plain = AgentSettings(model="m", block_size=16, worker_id="w")
    assert (plain.registered_host_engine_id(), plain.host_nixl_endpoint) == ("", "")
    flags = AgentSettings(
        model="m", block_size=16, worker_id="w", engine_id="e", host_nixl_endpoint="10.0.0.1:5700"
    )
    assert flags.registered_host_engine_id() == "e@host"
    named = AgentSettings(model="m", block_size=16, host_engine_id="pool", host_nixl_endpoint="h:1")
    assert named.registered_host_engine_id() == "pool"
    monkeypatch.setenv("KVLOOP_AGENT_HOST_NIXL_ENDPOINT", "10.0.0.2:5701")
    from_env = AgentSettings(model="m", block_size=16, worker_id="w")
    assert (from_env.host_nixl_endpoint, from_env.registered_host_engine_id()) == ("10.0.0.2:5701", "w@host")
    monkeypatch.delenv("KVLOOP_AGENT_HOST_NIXL_ENDPOINT")
    config = tmp_path / "agent.toml"
    config.write_text('host_engine_id = "e-pool"\nhost_nixl_endpoint = "10.0.0.3:5702"\n')
    monkeypatch.setenv("KVLOOP_AGENT_CONFIG", str(config))
    from_file = AgentSettings(model="m", block_size=16)
    assert (from_file.registered_host_engine_id(), from_file.host_nixl_endpoint) == (
        "e-pool",
        "10.0.0.3:5702",
    )


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"host_engine_id": "pool"}, "host_engine_id needs host_nixl_endpoint"),
        ({"host_nixl_endpoint": "no-port"}, "must be HOST:PORT"),
    ],
)
def test_a_half_or_malformed_host_pool_is_a_configuration_error(fields, fragment):
    with pytest.raises(ValidationError, match=fragment):
        AgentSettings(model="m", block_size=16, **fields)
