"""Stop signals on the real launchers: `kvloop demo --keep-running` (kvloopd, two `vllm serve` with their
engine-core processes, two sidecars, the proxy) and `kvloop engine` (one `vllm serve` + sidecar). After
the signal, no process the launcher started may be left (found through /proc by an environment mark
every descendant inherits). Every stop signal, and SIGKILL of the launcher, is checked on a cheap tree in
tests/test_processes.py, through the same supervisor code; here, where a launch costs engine starts, the
two paths that differ: a signal the launcher handles (SIGTERM; SIGINT and SIGHUP take the same handler)
and SIGKILL, which it cannot handle (its children go by their parent-death signal)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvloop.common.addresses import free_port, free_port_pair
from tests.e2e.conftest import HAVE_ENGINES
from tests.processes import Proc, exits_after_launcher, marked_env, marked_processes, read_line
from tests.support import wait_until

pytestmark = pytest.mark.engines

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    if not HAVE_ENGINES:
        pytest.fail("these tests need vLLM's CPU build and NIXL: run `make setup-engines` (make test does)")
    from kvloop.clients.fleet.model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("signals") / "model")


def vllm_groups(procs: list[Proc]) -> dict[int, list[Proc]]:
    """Process groups led by a `vllm serve`, with their members (the server and its engine core)."""
    leaders = [p.pid for p in procs if "kvloop.agents.vllm_main serve" in p.cmdline]
    return {pgid: [p for p in procs if p.pgid == pgid] for pgid in leaders}


def assert_all_gone(launcher: subprocess.Popen, mark: str, expected_code: int, log: Path) -> None:
    code = launcher.wait(120)
    assert code == expected_code, log.read_text()[-3000:]
    if code > 0:  # it stopped its children itself: only helpers that exit after it may outlive it
        assert [p for p in marked_processes(mark) if not exits_after_launcher(p)] == []
    wait_until(lambda: not marked_processes(mark), 60, "every process the launcher started to exit")


def kill_leftovers(mark: str) -> None:
    for proc in marked_processes(mark):
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=lambda s: s.name)
def test_demo_keep_running_stops_everything_on(sig, tmp_path):
    env, mark = marked_env()
    log = tmp_path / "demo.stderr"
    with log.open("w") as err:
        demo = subprocess.Popen(
            [
                *(str(BIN / "kvloop"), "--json", "demo", "--turns", "2", "--max-tokens", "4"),
                *("--keep-running", "--workdir", str(tmp_path / "demo")),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:

        def up() -> bool:
            assert demo.poll() is None, log.read_text()[-3000:]
            return "Everything keeps running" in log.read_text()

        wait_until(up, 600, "the demo to finish its turns and keep running", interval=0.5)
        procs = marked_processes(mark)
        groups = vllm_groups(procs)
        assert len(groups) == 2 and all(len(members) >= 2 for members in groups.values()), procs
        names = " ".join(p.cmdline for p in procs)
        assert "kvloopd" in names and names.count("kvloop-agent") == 2 and " proxy " in names
        demo.send_signal(sig)
        assert_all_gone(demo, mark, 128 + sig, log)
        assert f"{sig.name}: stopping everything" in log.read_text()
    finally:
        kill_leftovers(mark)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_engine_stops_vllm_and_sidecar(sig, tiny_model, daemon, tmp_path):
    env, mark = marked_env()
    log = tmp_path / "engine.stderr"
    with log.open("w") as err:
        engine = subprocess.Popen(
            [
                *(str(BIN / "kvloop"), "--daemon", daemon.address, "engine", "--role", "decode"),
                *("--model", str(tiny_model), "--worker-id", f"signals-{sig.name.lower()}"),
                *("--port", str(free_port()), "--nixl-port", str(free_port())),
                *("--kv-events-port", str(free_port_pair()), "--kv-cache-gib", "1", "--json"),
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    try:
        ready = json.loads(read_line(engine, 300))
        procs = marked_processes(mark)
        groups = vllm_groups(procs)
        assert list(groups) == [ready["pids"]["vllm"]], procs
        assert len(groups[ready["pids"]["vllm"]]) >= 2, procs  # vllm serve and its engine core
        assert any(p.pid == ready["pids"]["agent"] for p in procs)
        engine.send_signal(sig)
        assert_all_gone(engine, mark, 128 + sig if sig != signal.SIGKILL else -sig, log)
    finally:
        kill_leftovers(mark)
        if engine.stdout is not None:
            engine.stdout.close()
