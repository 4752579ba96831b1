"""The benchmarks' CPU meter (clients/bench/cpu.py) on real processes: a child that burns CPU on
command, and a real redis-server."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis

from kvloop.clients.bench.cpu import CpuMeter, ProcessCpu, per_request

# Burns CPU for the seconds of CPU time each line asks for, then answers "ok".
_BURNER = """
import sys, time
for line in sys.stdin:
    end = time.process_time() + float(line)
    while time.process_time() < end:
        pass
    print("ok", flush=True)
"""


@pytest.fixture
def burner() -> Iterator[subprocess.Popen]:
    process = subprocess.Popen(
        [sys.executable, "-c", _BURNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    burn(process, 0)  # its interpreter has started: the tests count only what they ask for
    yield process
    process.kill()
    process.wait()


def burn(process: subprocess.Popen, seconds: float) -> None:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(f"{seconds}\n")
    process.stdin.flush()
    assert process.stdout.readline().strip() == "ok"  # returns once the CPU time is spent


def test_process_cpu_counts_the_time_a_process_ran(burner):
    cpu = ProcessCpu(burner.pid)
    before = cpu.seconds()
    burn(burner, 0.3)
    spent = cpu.seconds() - before
    assert 0.29 <= spent < 0.45


def test_windows_and_the_rest_add_up_to_the_whole(burner):
    meter = CpuMeter(burner.pid)
    meter.start()
    with meter.window("lookup"):
        burn(burner, 0.2)
    burn(burner, 0.1)  # outside every window: the rest
    with meter.window("route"):
        burn(burner, 0.05)
    meter.stop()
    split = meter.daemon_split
    assert 0.19 <= split.parts["lookup"] < 0.3
    assert 0.049 <= split.parts["route"] < 0.1
    figures = per_request(split, 10, rest="ingest")
    by_part = figures["cpu_ms_per_request_by_part"]
    assert 9.9 <= by_part["ingest"] < 15  # 0.1 s over 10 requests
    assert sum(by_part.values()) == pytest.approx(figures["cpu_ms_per_request"], abs=1e-3)
    assert figures["requests_per_s_per_core"] == pytest.approx(1000 / figures["cpu_ms_per_request"], abs=0.1)


def test_redis_cpu_is_charged_without_the_readings_own_cost(redis_url):
    meter = CpuMeter(os.getpid(), redis_url)
    client = redis.Redis.from_url(redis_url)
    try:
        assert meter.redis is not None
        per_reading = meter.redis.calibrate(200)
        assert 0 < per_reading < 0.001  # an INFO cpu costs the server microseconds
        meter.start()
        with meter.window("idle"):
            pass
        with meter.window("work"):
            with client.pipeline(transaction=False) as pipe:
                for i in range(20_000):
                    pipe.set(f"cpu-test:{i}", i)
                pipe.execute()
        meter.stop()
        client.delete(*(f"cpu-test:{i}" for i in range(20_000)))
    finally:
        client.close()
        meter.close()
    parts = meter.redis_split.parts  # type: ignore[union-attr]
    assert parts["work"] > 0.005  # 20,000 SETs are milliseconds of server CPU
    assert abs(parts["idle"]) < parts["work"] / 10  # an empty window is charged about nothing
