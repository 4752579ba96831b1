"""`kvloop bench fuzz`: hypothesis-built kvloop.v1 messages against a real kvloopd process.

Every input is one call to the Directory service: a unary request of any RPC, or a Connect stream
(a script of ConnectRequests). Inputs are well-formed, mutated (fields set out of range, wrong hash
widths, replayed / skipped sequences, wrong epochs, oversized fields) or raw bytes (a well-formed
message with flipped, cut or inserted bytes, or random bytes) sent under the RPC's path. Each is
sent with one of the daemon's bearer tokens (agent tokens bound to one fuzz worker id each), a
wrong one, or none.

Every answer must be OK or a precise status; UNKNOWN, INTERNAL, UNAVAILABLE and DEADLINE_EXCEEDED
count as failures. Before the fuzzing a well-behaved agent (the sidecar's real ``DirectoryLink``)
publishes stored and retained runs; some inputs reuse its block hashes and its worker id. After
the run the daemon must answer health, the good agent's state must read back exactly as before
(ListWorkers, FindBlock, Lookup), and the directory's counters must agree with each other.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import secrets
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from kvloop.clients.bench.common import start_daemon
from kvloop.clients.directory_client import AsyncDirectoryClient, DirectoryClient
from kvloop.common.processes import supervisor
from kvloop.common.security import ClientSecurity
from kvloop.v1 import directory_pb2 as pb

MODEL = "fuzz-model"
OTHER_MODEL = "fuzz-other"
GOOD_DECODE = "good-decode"
GOOD_PREFILL = "good-prefill"
PROTECTED = (GOOD_DECODE, GOOD_PREFILL)
FUZZ_WORKERS = tuple(f"fuzz-{i}" for i in range(4))
BLOCK_SIZE = 16
HASH_LENGTH = 32
GOOD_LORA = "tenant-a"
# Small limits on the fuzzed daemon so that "too many hashes" and "message too large" are cheap to reach.
MAX_HASHES = 64
MAX_MESSAGE_BYTES = 64 * 1024

# Statuses that are a precise answer to a bad (or good) input. Anything else is a failure: UNKNOWN and
# INTERNAL are unhandled exceptions, UNAVAILABLE a dead daemon, DEADLINE_EXCEEDED a hung call.
PRECISE = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)

UNARY = {
    "Lookup": (pb.LookupRequest, pb.LookupResponse),
    "ListWorkers": (pb.ListWorkersRequest, pb.ListWorkersResponse),
    "FindBlock": (pb.FindBlockRequest, pb.FindBlockResponse),
    "GetStats": (pb.GetStatsRequest, pb.GetStatsResponse),
    "DrainWorker": (pb.DrainWorkerRequest, pb.DrainWorkerResponse),
    "ListPairs": (pb.ListPairsRequest, pb.ListPairsResponse),
    "ReleaseClaim": (pb.ReleaseClaimRequest, pb.ReleaseClaimResponse),
    "Route": (pb.RouteRequest, pb.RouteResponse),
}
STREAMING = ("Connect", "Watch")
SERVICE = "/kvloop.v1.Directory/"


def _chain(name: str, blocks: int) -> list[bytes]:
    import hashlib

    parent, out = b"", []
    for i in range(blocks):
        parent = hashlib.sha256(parent + f"{name}:{i}".encode()).digest()
        out.append(parent)
    return out


# The well-behaved agents' runs: the fuzzer reuses these hashes so that its events collide with them.
GOOD_RETAINED = _chain("good-retained", 8)
GOOD_STORED = _chain("good-stored", 6)
GOOD_LORA_RUN = _chain("good-lora", 4)
KNOWN_HASHES = GOOD_RETAINED + GOOD_STORED + GOOD_LORA_RUN


@dataclass(frozen=True)
class Tokens:
    admin: str
    read: str
    prefill: str
    agents: dict[str, str]  # fuzz worker id -> agent token bound to it
    good: dict[str, str]  # protected worker id -> its bound agent token (never used by the fuzzer)

    @classmethod
    def fresh(cls) -> Tokens:
        def t() -> str:
            return secrets.token_hex(16)

        return cls(t(), t(), t(), {w: t() for w in FUZZ_WORKERS}, {w: t() for w in PROTECTED})

    def grants(self) -> list[dict[str, Any]]:
        grants: list[dict[str, Any]] = [
            {"token": self.admin, "role": "admin"},
            {"token": self.read, "role": "read"},
            {"token": self.prefill, "role": "prefill"},
        ]
        for worker, token in {**self.agents, **self.good}.items():
            grants.append({"token": token, "role": "agent", "worker_id": worker})
        return grants

    def fuzz_choices(self) -> list[str | None]:
        """Tokens an input may carry: each role's, an unknown one, none (never the good agents')."""
        return [self.admin, self.read, self.prefill, *self.agents.values(), "x" * 32, None]


# ---- strategies ---------------------------------------------------------------------------------

_u32 = st.integers(0, 2**32 - 1)
_u64 = st.integers(0, 2**64 - 1)
_small = st.integers(0, 8)
# packed_hash_bytes: unset, the keys' width, the model's whole hashes, or anything
_hash_widths = st.one_of(st.sampled_from([0, 8, 32]), _small, _u32)


def _text(max_size: int = 24) -> st.SearchStrategy[str]:
    return st.text(max_size=max_size)


def _oversized_text() -> st.SearchStrategy[str]:
    return st.integers(257, 4096).map(lambda n: "w" * n)


def hashes(width: int = HASH_LENGTH) -> st.SearchStrategy[list[bytes]]:
    """Block-hash lists: mostly the right width (often the good agents' own), sometimes not."""
    good_width = st.one_of(st.sampled_from(KNOWN_HASHES), st.binary(min_size=width, max_size=width))
    any_width = st.one_of(good_width, st.binary(max_size=2 * width + 1))
    return st.one_of(
        st.lists(good_width, min_size=1, max_size=6),
        st.lists(any_width, max_size=6),
        st.just(KNOWN_HASHES[:8]),
        st.integers(MAX_HASHES + 1, MAX_HASHES + 8).map(
            lambda n: [bytes([i % 256]) * width for i in range(n)]
        ),
    )


def models() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from([MODEL, OTHER_MODEL, ""]), _text())


def loras() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(["", GOOD_LORA, "tenant-b"]), _text(8))


def worker_ids() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(FUZZ_WORKERS + PROTECTED + ("",)), _text(), _oversized_text())


def layouts() -> st.SearchStrategy[pb.ParallelLayout]:
    return st.builds(
        pb.ParallelLayout,
        tensor_parallel_size=st.one_of(st.sampled_from([0, 1, 2]), _u32),
        pipeline_parallel_size=st.sampled_from([0, 1, 2]),
        data_parallel_size=st.sampled_from([0, 1]),
        data_parallel_rank=_small,
    )


def registrations(
    worker_id: st.SearchStrategy[str] | None = None,
) -> st.SearchStrategy[pb.WorkerRegistration]:
    return st.builds(
        pb.WorkerRegistration,
        worker_id=worker_ids() if worker_id is None else worker_id,
        role=st.one_of(st.sampled_from([1, 2, 3]), st.sampled_from([0, 7, 2**31 - 1])),
        model=st.one_of(st.just(MODEL), models()),
        engine_id=_text(),
        nixl_endpoint=st.one_of(st.just("127.0.0.1:5600"), _text()),
        block_size=st.one_of(st.just(BLOCK_SIZE), _u32),
        hash_algorithm=st.sampled_from(["sha256_cbor", "", "md5"]),
        parallel=layouts(),
        epoch=st.one_of(st.integers(1, 2**64 - 1), st.just(0)),
        kv_bytes_per_block=st.one_of(st.just(65536), _u64),
        hash_length=st.one_of(st.just(HASH_LENGTH), st.sampled_from([0, 7, 8, 64, 65]), _u32),
        http_endpoint=_text(),
        labels=st.dictionaries(_text(8), _text(8), max_size=3),
        last_sequence=st.one_of(st.just(0), _u64),
        kv_dtype=st.sampled_from(["", "bfloat16", "float32"]),
    )


def block_events() -> st.SearchStrategy[pb.BlockEvent]:
    ids = st.lists(_u32, max_size=16)
    stored = st.builds(
        pb.BlocksStored,
        block_hashes=hashes(),
        parent_block_hash=st.binary(max_size=40),
        lora_name=loras(),
        tier=st.integers(0, 4),
    )
    retained = st.builds(
        pb.BlocksRetained,
        block_hashes=hashes(),
        block_ids=ids,
        num_groups=st.one_of(st.sampled_from([0, 1, 2]), _u32),
        retention_handle=st.one_of(st.sampled_from(["", "h-1", "h-2"]), _text()),
        expires_in_ms=st.one_of(st.sampled_from([0, 1, 60_000]), _u64),
        single_use=st.booleans(),
        lora_name=loras(),
        tier=st.integers(0, 4),
        tail_token_ids=st.lists(_u32, max_size=BLOCK_SIZE + 1),
        tail_block_ids=st.lists(_u32, max_size=3),
        block_digests=st.one_of(st.just(b""), st.binary(max_size=48)),
    )
    return st.one_of(
        stored.map(lambda m: pb.BlockEvent(stored=m)),
        retained.map(lambda m: pb.BlockEvent(retained=m)),
        st.builds(pb.BlocksRemoved, block_hashes=hashes(), lora_name=loras()).map(
            lambda m: pb.BlockEvent(removed=m)
        ),
        st.builds(pb.RetentionReleased, retention_handle=st.sampled_from(["", "h-1", "h-2", "good-run"])).map(
            lambda m: pb.BlockEvent(released=m)
        ),
        st.just(pb.BlockEvent(cleared=pb.AllBlocksCleared())),
        st.builds(
            pb.TransferReport,
            source_worker_id=worker_ids(),
            bytes=_u64,
            blocks=_u32,
            duration_us=_u64,
            setup_us=_u64,
            ok=st.booleans(),
            first_contact=st.booleans(),
            nixl_measured=st.booleans(),
            wait_us=_u64,
        ).map(lambda m: pb.BlockEvent(transfer=m)),
        st.builds(pb.PrefillReport, tokens=_u64, duration_us=_u64).map(lambda m: pb.BlockEvent(prefill=m)),
        st.just(pb.BlockEvent()),
    )


def valid_registrations() -> st.SearchStrategy[pb.WorkerRegistration]:
    """What a correct agent of a fuzz worker sends: so that most scripts get past registration."""
    return st.builds(
        pb.WorkerRegistration,
        worker_id=st.sampled_from(FUZZ_WORKERS),
        role=st.sampled_from([1, 2, 3]),
        model=st.just(MODEL),
        nixl_endpoint=st.just("127.0.0.1:5600"),
        block_size=st.just(BLOCK_SIZE),
        hash_algorithm=st.just("sha256_cbor"),
        hash_length=st.just(HASH_LENGTH),
        epoch=st.integers(1, 2**64 - 1),
        last_sequence=st.one_of(st.just(0), st.integers(1, 8)),
    )


# Built once: constructing these per draw costs more than drawing from them.
REGISTRATIONS = st.one_of(valid_registrations(), valid_registrations(), registrations())
REGISTRATION_OF = {w: registrations(st.just(w)) for w in FUZZ_WORKERS}
BLOCK_EVENTS = block_events()


@st.composite
def connect_scripts(draw: st.DrawFn) -> list[pb.ConnectRequest]:
    """A Connect stream: usually a registration, then batches (in order, replayed, skipping ahead,
    out of order), heartbeats, snapshots, repeated registrations and empty messages."""
    script: list[pb.ConnectRequest] = []
    if draw(st.integers(0, 9)):  # mostly register first
        script.append(pb.ConnectRequest(register=draw(REGISTRATIONS)))
    sequence = 0
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(
            st.sampled_from(
                [
                    "batch",
                    "batch",
                    "batch",
                    "heartbeat",
                    "snapshot_begin",
                    "snapshot_end",
                    "register",
                    "empty",
                ]
            )
        )
        if kind == "batch":
            step = draw(st.sampled_from(["next", "next", "replay", "skip", "zero", "huge"]))
            if step == "next":
                sequence += 1
                number = sequence
            else:
                number = {
                    "replay": max(sequence, 1),
                    "skip": sequence + draw(st.integers(2, 5)),
                    "zero": 0,
                    "huge": 2**64 - 1,
                }[step]
            events = draw(st.lists(BLOCK_EVENTS, max_size=4))
            script.append(pb.ConnectRequest(batch=pb.EventBatch(sequence=number, events=events)))
        elif kind == "heartbeat":
            script.append(pb.ConnectRequest(heartbeat=pb.Heartbeat(sent_at_us=draw(_u64))))
        elif kind == "snapshot_begin":
            script.append(pb.ConnectRequest(snapshot_begin=pb.SnapshotBegin()))
        elif kind == "snapshot_end":
            end = draw(st.one_of(st.just(sequence), _u64))
            script.append(pb.ConnectRequest(snapshot_end=pb.SnapshotEnd(sequence=end)))
        elif kind == "register":
            script.append(pb.ConnectRequest(register=draw(REGISTRATIONS)))
        else:
            script.append(pb.ConnectRequest())
    return script


def unary_requests() -> st.SearchStrategy[tuple[str, Any]]:
    lookup = st.builds(
        pb.LookupRequest,
        model=models(),
        lora_name=loras(),
        block_hashes=st.one_of(st.just([]), hashes()),
        local_blocks=st.one_of(_small, _u32),
        requester_worker_id=worker_ids(),
        claim=st.booleans(),
        block_size=st.one_of(st.sampled_from([0, BLOCK_SIZE]), _u32),
        packed_block_hashes=st.one_of(
            st.just(b""), hashes().map(b"".join), st.binary(max_size=200), st.just(b"".join(GOOD_RETAINED))
        ),
        pack_block_ids=st.booleans(),
        min_pull_tokens=st.one_of(st.just(0), _u32),
        lease_margin_ms=st.one_of(st.just(0), _u32),
        parallel=layouts(),
        kv_dtype=st.sampled_from(["", "bfloat16", "fp8_e4m3"]),
        kv_bytes_per_block=st.one_of(st.just(0), _u64),
        packed_hash_bytes=_hash_widths,
    )
    candidate = st.builds(
        pb.RouteCandidate,
        worker_id=worker_ids(),
        http_endpoint=st.one_of(st.just(""), _text(), st.just("http://127.0.0.1:1")),
        in_flight_requests=st.one_of(_small, _u32),
        queued_tokens=st.one_of(st.just(0), _u64),
    )
    route = st.builds(
        pb.RouteRequest,
        model=models(),
        lora_name=loras(),
        block_hashes=st.one_of(st.just([]), hashes()),
        packed_block_hashes=st.one_of(st.just(b""), hashes().map(b"".join), st.binary(max_size=200)),
        token_ids=st.one_of(st.just([]), st.lists(st.one_of(_small, _u32), max_size=80)),
        cache_salt=st.one_of(st.just(""), _text()),
        candidates=st.lists(candidate, max_size=5),
        block_size=st.one_of(st.sampled_from([0, BLOCK_SIZE]), _u32),
        prompt_tokens=st.one_of(st.just(0), _u32),
        packed_hash_bytes=_hash_widths,
    )
    return st.one_of(
        st.tuples(st.just("Lookup"), lookup),
        st.tuples(st.just("Route"), route),
        st.tuples(st.just("ListWorkers"), st.builds(pb.ListWorkersRequest, model=models())),
        st.tuples(
            st.just("FindBlock"),
            st.builds(
                pb.FindBlockRequest,
                model=models(),
                lora_name=loras(),
                block_hash=st.one_of(st.sampled_from(KNOWN_HASHES), st.binary(max_size=40)),
            ),
        ),
        st.tuples(st.just("GetStats"), st.just(pb.GetStatsRequest())),
        st.tuples(st.just("ListPairs"), st.builds(pb.ListPairsRequest, model=models())),
        st.tuples(
            st.just("DrainWorker"),
            st.builds(
                pb.DrainWorkerRequest,
                # The admin may drain anyone: the good agents are kept out of the fuzzer's reach here
                # (their isolation from other agents' tokens is tested apart).
                worker_id=worker_ids().filter(lambda w: w not in PROTECTED),
                reason=_text(),
            ),
        ),
        st.tuples(
            st.just("ReleaseClaim"),
            st.builds(
                pb.ReleaseClaimRequest,
                model=models(),
                lora_name=loras(),
                holder_worker_id=worker_ids(),
                retention_handle=st.sampled_from(["", "good-run", "h-1", "h-2"]),
                requester_worker_id=worker_ids(),
            ),
        ),
        st.tuples(st.just("Watch"), st.builds(pb.WatchRequest, model=models())),
    )


@st.composite
def mutated_bytes(draw: st.DrawFn, message: Any) -> bytes:
    """A serialized message with bytes flipped, cut out, inserted, or the tail cut off."""
    data = bytearray(message.SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "delete", "insert", "truncate"]))
        at = draw(st.integers(0, len(data)))
        if op == "flip" and at < len(data):
            data[at] ^= draw(st.integers(1, 255))
        elif op == "delete" and at < len(data):
            del data[at : at + draw(st.integers(1, 4))]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        else:
            del data[at:]
    return bytes(data)


def _raw(message: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    return st.one_of(message.flatmap(mutated_bytes), st.binary(max_size=64))


@dataclass(frozen=True)
class Case:
    """One input: an RPC, what it carries (messages, or raw bytes when `raw`) and the token it uses."""

    method: str
    payload: Any  # a message, a list of ConnectRequests, bytes, or a list of bytes (raw Connect)
    raw: bool
    token: str | None


def cases(tokens: Tokens) -> st.SearchStrategy[Case]:
    token = st.sampled_from(tokens.fuzz_choices())
    agent_token = st.sampled_from([*tokens.agents.values(), tokens.admin, tokens.read, None])
    scripts = connect_scripts()
    requests = unary_requests()
    raw_frame = _raw(scripts.map(lambda s: s[0] if s else pb.ConnectRequest()))

    @st.composite
    def connect(draw: st.DrawFn) -> Case:
        # Mostly a token bound to the worker the script registers, so that inputs reach the session.
        script = draw(scripts)
        chosen = draw(agent_token)
        first = script[0] if script else None
        if first is not None and first.HasField("register") and draw(st.integers(0, 3)):
            chosen = tokens.agents.get(first.register.worker_id, chosen)
        return Case("Connect", script, False, chosen)

    @st.composite
    def raw_connect(draw: st.DrawFn) -> Case:
        worker = draw(st.sampled_from(FUZZ_WORKERS))
        first = pb.ConnectRequest(register=draw(REGISTRATION_OF[worker]))
        rest = draw(st.lists(raw_frame, max_size=4))
        frames = [first.SerializeToString(), *rest] if draw(st.booleans()) else rest
        return Case("Connect", frames, True, tokens.agents[worker])

    @st.composite
    def unary(draw: st.DrawFn) -> Case:
        method, request = draw(requests)
        return Case(method, request, False, draw(token))

    @st.composite
    def raw_unary(draw: st.DrawFn) -> Case:
        method, request = draw(requests)
        data = draw(st.one_of(mutated_bytes(request), st.binary(max_size=64)))
        return Case(method, data, True, draw(st.sampled_from([tokens.admin, tokens.prefill])))

    @st.composite
    def oversized(draw: st.DrawFn) -> Case:
        # Beyond the daemon's max_message_bytes: refused before it is parsed.
        size = draw(st.integers(MAX_MESSAGE_BYTES + 1, MAX_MESSAGE_BYTES + 4096))
        return Case(
            "Lookup", pb.LookupRequest(model=MODEL, packed_block_hashes=b"\x01" * size), False, tokens.prefill
        )

    weighted = [connect()] * 16 + [unary()] * 12 + [raw_unary()] * 4 + [raw_connect()] * 4 + [oversized()]
    return st.one_of(weighted)


# ---- the run ------------------------------------------------------------------------------------


@dataclass
class FuzzConfig:
    inputs: int = 100_000
    seed: int = 0
    listen: str = "127.0.0.1:0"
    call_timeout_s: float = 5.0
    # memory, redis (a throwaway redis-server from PATH) or a redis:// URL (its database is flushed)
    store: str = "memory"
    # Stop early after this long (the result says how many inputs ran); None: run them all.
    max_seconds: float | None = None


@dataclass
class FuzzResult:
    inputs: int = 0
    messages: int = 0
    seconds: float = 0.0
    inputs_per_s: float = 0.0
    crashes: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    statuses_by_method: dict[str, dict[str, int]] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)
    failure_count: int = 0
    invariant_violations: list[str] = field(default_factory=list)
    seed: int = 0
    stopped_early: bool = False
    # Connect streams of the good agents that ended during the run (they reconnect by themselves; a
    # lease lapsing on a starved machine does it, so it is reported apart from the invariants).
    good_agent_reconnects: int = 0


class _Stop(Exception):
    """Ends the hypothesis run at the time limit (generation only: nothing is shrunk)."""


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class _Caller:
    """Sends a Case over one channel and returns its final status."""

    def __init__(self, channel: grpc.Channel, timeout: float) -> None:
        self.timeout = timeout
        self._typed: dict[str, Any] = {}
        self._raw: dict[str, Any] = {}
        for method, (request, response) in UNARY.items():
            self._typed[method] = channel.unary_unary(
                SERVICE + method,
                request_serializer=request.SerializeToString,
                response_deserializer=response.FromString,
            )
            self._raw[method] = channel.unary_unary(SERVICE + method)
        self._typed["Watch"] = channel.unary_stream(
            SERVICE + "Watch",
            request_serializer=pb.WatchRequest.SerializeToString,
            response_deserializer=pb.WatchResponse.FromString,
        )
        self._raw["Watch"] = channel.unary_stream(SERVICE + "Watch")
        self._typed["Connect"] = channel.stream_stream(
            SERVICE + "Connect",
            request_serializer=pb.ConnectRequest.SerializeToString,
            response_deserializer=pb.ConnectResponse.FromString,
        )
        self._raw["Connect"] = channel.stream_stream(SERVICE + "Connect")

    def call(self, case: Case) -> tuple[grpc.StatusCode, str]:
        table = self._raw if case.raw else self._typed
        stub = table[case.method]
        metadata = _metadata(case.token)
        try:
            if case.method == "Connect":
                for _ in stub(iter(case.payload), metadata=metadata, timeout=self.timeout):
                    pass
            elif case.method == "Watch":
                # An open change feed is the right answer: a short deadline ends it.
                try:
                    for _ in stub(case.payload, metadata=metadata, timeout=0.05):
                        pass
                except grpc.RpcError as exc:
                    if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                        return grpc.StatusCode.OK, ""
                    raise
            else:
                stub(case.payload, metadata=metadata, timeout=self.timeout)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""


def _describe(case: Case) -> str:
    if case.raw:
        frames = case.payload if isinstance(case.payload, list) else [case.payload]
        return f"{case.method} raw " + " ".join(bytes(f).hex()[:160] for f in frames)
    if isinstance(case.payload, list):
        return f"{case.method} " + " | ".join(str(m).replace("\n", " ")[:200] for m in case.payload)
    return f"{case.method} " + str(case.payload).replace("\n", " ")[:400]


# ---- the daemon and the well-behaved agents -------------------------------------------------------


def start_fuzz_daemon(
    workdir: Path, tokens: Tokens, listen: str = "127.0.0.1:0", store: str = "memory"
) -> tuple[subprocess.Popen, str]:
    env = {
        "KVLOOP_TOKENS": json.dumps(tokens.grants()),
        "KVLOOP_MAX_HASHES_PER_MESSAGE": str(MAX_HASHES),
        "KVLOOP_MAX_MESSAGE_BYTES": str(MAX_MESSAGE_BYTES),
        # Fuzz workers lapse and are dropped quickly, so a long run's directory stays small.
        "KVLOOP_LEASE_S": "10",
        "KVLOOP_HEARTBEAT_INTERVAL_S": "1",
        "KVLOOP_DROP_AFTER_S": "10",
    }
    return start_daemon(listen, workdir, ("--store", store, "--log-level", "warning"), env)


def good_registration(worker_id: str, role: int, epoch: int) -> pb.WorkerRegistration:
    return pb.WorkerRegistration(
        worker_id=worker_id,
        role=role,
        model=MODEL,
        engine_id=f"engine-{worker_id}",
        nixl_endpoint="127.0.0.1:5999",
        block_size=BLOCK_SIZE,
        hash_algorithm="sha256_cbor",
        hash_length=HASH_LENGTH,
        epoch=epoch,
        kv_bytes_per_block=65536,
        kv_dtype="bfloat16",
    )


def good_events() -> list[pb.BlockEvent]:
    ids = list(range(100, 100 + len(GOOD_RETAINED)))
    lora_ids = list(range(200, 200 + len(GOOD_LORA_RUN)))
    return [
        pb.BlockEvent(stored=pb.BlocksStored(block_hashes=GOOD_STORED, tier=pb.BLOCK_TIER_DEVICE)),
        pb.BlockEvent(
            retained=pb.BlocksRetained(
                block_hashes=GOOD_RETAINED,
                block_ids=ids,
                num_groups=1,
                retention_handle="good-run",
                expires_in_ms=3_600_000,
                tier=pb.BLOCK_TIER_DEVICE,
            )
        ),
        pb.BlockEvent(
            retained=pb.BlocksRetained(
                block_hashes=GOOD_LORA_RUN,
                block_ids=lora_ids,
                num_groups=1,
                retention_handle="good-lora-run",
                expires_in_ms=3_600_000,
                lora_name=GOOD_LORA,
                tier=pb.BLOCK_TIER_DEVICE,
            )
        ),
    ]


async def _good_agents(target: str, tokens: Tokens, conn: Any) -> None:
    from kvloop.agents.sidecar.link import DirectoryLink

    epoch = random.getrandbits(62) | 1
    links, tasks, clients = [], [], []
    for worker, role, events in (
        (GOOD_DECODE, pb.WORKER_ROLE_DECODE, good_events()),
        (GOOD_PREFILL, pb.WORKER_ROLE_PREFILL, []),
    ):
        client = AsyncDirectoryClient(target, ClientSecurity(token=tokens.good[worker]))
        clients.append(client)
        link = DirectoryLink(client, good_registration(worker, role, epoch), snapshot=lambda e=events: e)
        tasks.append(asyncio.create_task(link.run()))
        await asyncio.wait_for(link.connected.wait(), 30)
        if events:
            link.publish(events)
            await link.wait_acked(timeout=30)
        links.append(link)
    loop = asyncio.get_running_loop()
    conn.send("ready")
    while (await loop.run_in_executor(None, conn.recv)) != "stop":
        conn.send({link.worker_id: (link.connected.is_set(), link.sessions) for link in links})
    conn.send({link.worker_id: (link.connected.is_set(), link.sessions) for link in links})
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for client in clients:
        await client.close()


def _good_agents_process(target: str, tokens: Tokens, conn: Any) -> None:
    from kvloop.common.logging import configure_logging
    from kvloop.common.processes import die_with_parent

    parent = multiprocessing.parent_process()
    die_with_parent(parent_pid=parent.pid if parent else None)
    configure_logging("warning")
    asyncio.run(_good_agents(target, tokens, conn))


class GoodAgents:
    """Real sidecar links (``DirectoryLink``) in their own process (grpc.aio and the fuzzer's blocking
    channel do not share a process well): they publish once, then heartbeat for the whole run."""

    def __init__(self, target: str, tokens: Tokens) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_good_agents_process, args=(target, tokens, child), daemon=True)

    def __enter__(self) -> GoodAgents:
        self._process.start()
        if not self._conn.poll(60) or self._conn.recv() != "ready":
            raise RuntimeError("the well-behaved agents did not register and publish within 60 s")
        return self

    def sessions(self, final: bool = False) -> dict[str, tuple[bool, int]]:
        """Per good worker: (connected now, Connect sessions so far: 1 means its stream was never cut)."""
        self._conn.send("stop" if final else "status")
        return self._conn.recv()

    def __exit__(self, *exc: object) -> None:
        if self._process.is_alive():
            self._process.terminate()
        self._process.join(10)


# ---- invariants ---------------------------------------------------------------------------------


def _worker_view(info: pb.WorkerInfo) -> dict:
    return {
        "registration": info.registration.SerializeToString(deterministic=True),
        "lease_state": info.lease_state,
        "connected": info.connected,
        "stored_blocks": info.stored_blocks,
        "retained_blocks": info.retained_blocks,
        "retained_runs": info.retained_runs,
    }


def _locations(locations: list[pb.BlockLocation], worker: str) -> list[tuple]:
    return sorted(
        (loc.kind, loc.position, tuple(loc.block_ids), loc.retention_handle, loc.servable, loc.tier)
        for loc in locations
        if loc.worker_id == worker
    )


def observe_good(client: DirectoryClient) -> dict:
    """What public RPCs say about the good agents' state (times left out: they move)."""
    workers = {w.registration.worker_id: w for w in client.list_workers()}
    state: dict[str, Any] = {"workers": {w: _worker_view(workers[w]) for w in PROTECTED if w in workers}}
    state["find"] = {
        (lora, h): _locations(client.find_block(MODEL, h, lora_name=lora), GOOD_DECODE)
        for lora, run in (("", GOOD_RETAINED + GOOD_STORED), (GOOD_LORA, GOOD_LORA_RUN))
        for h in run
    }
    lookups = {}
    for lora, run in (("", GOOD_RETAINED), (GOOD_LORA, GOOD_LORA_RUN)):
        answer = client.lookup(MODEL, run, lora_name=lora, requester=GOOD_PREFILL)
        holders = [answer.holder, *answer.other_holders] if answer.HasField("holder") else []
        lookups[lora] = sorted(
            (h.matched_blocks, tuple(h.block_ids), h.retention_handle, h.epoch)
            for h in holders
            if h.worker_id == GOOD_DECODE
        )
    state["lookups"] = lookups
    return state


def _settled_views(
    client: DirectoryClient, attempts: int = 20
) -> tuple[list[pb.WorkerInfo], pb.GetStatsResponse]:
    """ListWorkers and a GetStats that saw the same workers.

    Each call reads the directory at its own instant, and the fuzzed workers' leases lapse on their
    own, so a lease ending between the two calls is not a disagreement. GetStats is taken between two
    ListWorkers that list the same workers and runs; only then must the counts agree.
    """
    workers = client.list_workers()
    for _ in range(attempts):
        stats = client.stats()
        after = client.list_workers()
        if _roster(after) == _roster(workers):
            return workers, stats
        workers = after
    return workers, stats


def _roster(workers: list[pb.WorkerInfo]) -> list[tuple[str, int]]:
    return sorted((w.registration.worker_id, w.retained_runs) for w in workers)


def check_invariants(client: DirectoryClient, baseline: dict) -> list[str]:
    """The good agents' state is unchanged, and the directory's views agree with each other."""
    problems: list[str] = []
    now = observe_good(client)
    for worker, view in baseline["workers"].items():
        if now["workers"].get(worker) != view:
            problems.append(f"worker {worker} changed: {view} -> {now['workers'].get(worker)}")
    for key, locations in baseline["find"].items():
        if now["find"].get(key) != locations:
            problems.append(
                f"FindBlock{key[0] or ''} {key[1].hex()[:16]}: {locations} -> {now['find'].get(key)}"
            )
    for lora, holders in baseline["lookups"].items():
        if now["lookups"].get(lora) != holders:
            problems.append(
                f"Lookup (lora {lora!r}) of the good run: {holders} -> {now['lookups'].get(lora)}"
            )
    # Tenant isolation: the good run is found under its own LoRA namespace only.
    for lora, run in (("tenant-b", GOOD_LORA_RUN), ("", GOOD_LORA_RUN), (GOOD_LORA, GOOD_RETAINED)):
        answer = client.lookup(MODEL, run, lora_name=lora, requester=GOOD_PREFILL)
        holders = [answer.holder, *answer.other_holders] if answer.HasField("holder") else []
        if any(h.worker_id == GOOD_DECODE for h in holders):
            problems.append(f"Lookup under lora {lora!r} returned the good agent's run of another namespace")
    workers, stats = _settled_views(client)
    if stats.workers != len(workers):
        problems.append(f"GetStats.workers {stats.workers} != ListWorkers {len(workers)}")
    if stats.retained_runs != sum(w.retained_runs for w in workers):
        problems.append(
            f"GetStats.retained_runs {stats.retained_runs} != sum over ListWorkers "
            f"{sum(w.retained_runs for w in workers)}"
        )
    if stats.entries > stats.max_entries:
        problems.append(f"entries {stats.entries} over max_entries {stats.max_entries}")
    known = {w.registration.worker_id for w in workers}
    for h in KNOWN_HASHES:
        for lora in ("", GOOD_LORA, "tenant-b"):
            for loc in client.find_block(MODEL, h, lora_name=lora):
                if loc.worker_id not in known:
                    problems.append(f"FindBlock names {loc.worker_id!r}, which ListWorkers does not know")
    return problems


def health_ok(channel: grpc.Channel) -> bool:
    try:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError:
        return False
    return answer.status == health_pb2.HealthCheckResponse.SERVING


# ---- driver -------------------------------------------------------------------------------------


@contextmanager
def fuzz_target(
    listen: str = "127.0.0.1:0", store: str = "memory"
) -> Iterator[tuple[subprocess.Popen, str, Tokens, Path]]:
    """A fresh kvloopd with tokens on ``store`` (memory, redis: a throwaway redis-server, or a redis://
    URL, flushed), and a workdir with its log; stopped and removed on exit."""
    if store not in ("memory", "redis") and not store.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"--store must be memory, redis or a redis:// URL, got {store!r}")
    workdir = Path(tempfile.mkdtemp(prefix="kvloop-fuzz-"))
    tokens = Tokens.fresh()
    with ExitStack() as stack:
        if store == "redis":
            from kvloop.clients.fleet.redis_local import local_redis

            store = stack.enter_context(local_redis(workdir))
        elif store != "memory":
            import redis

            with redis.Redis.from_url(store) as client:
                client.flushdb()
        process, address = start_fuzz_daemon(workdir, tokens, listen, store)
        try:
            yield process, address, tokens, workdir
        finally:
            supervisor().stop(process, grace_s=10)
    shutil.rmtree(workdir, ignore_errors=True)


def fuzz_daemon(
    address: str,
    tokens: Tokens,
    process: subprocess.Popen,
    config: FuzzConfig,
    on_input: Callable[[int], None] | None = None,
) -> FuzzResult:
    """Run `config.inputs` inputs against a kvloopd that holds the good agents' state."""
    result = FuzzResult(seed=config.seed)
    statuses: Counter[str] = Counter()
    by_method: dict[str, Counter[str]] = {}
    channel = grpc.insecure_channel(
        address, options=[("grpc.max_send_message_length", 4 * MAX_MESSAGE_BYTES)]
    )
    caller = _Caller(channel, config.call_timeout_s)
    started = time.perf_counter()
    deadline = started + config.max_seconds if config.max_seconds else None

    @settings(
        max_examples=config.inputs,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases(tokens))
    def one(case: Case) -> None:
        if result.crashes or (deadline is not None and time.perf_counter() > deadline):
            result.stopped_early = result.inputs < config.inputs
            raise _Stop
        code, details = caller.call(case)
        result.inputs += 1
        result.messages += len(case.payload) if isinstance(case.payload, list) else 1
        statuses[code.name] += 1
        by_method.setdefault(case.method, Counter())[code.name] += 1
        if code not in PRECISE:
            result.failure_count += 1
            if len(result.failures) < 20:
                result.failures.append({"status": code.name, "details": details, "input": _describe(case)})
            if process.poll() is not None or not health_ok(channel):
                result.crashes += 1
        if on_input:
            on_input(result.inputs)

    try:
        hypothesis_seed(config.seed)(one)()
    except _Stop:
        pass
    finally:
        result.seconds = time.perf_counter() - started
        channel.close()
    result.inputs_per_s = round(result.inputs / result.seconds, 1) if result.seconds else 0.0
    result.statuses = dict(statuses.most_common())
    result.statuses_by_method = {m: dict(c.most_common()) for m, c in sorted(by_method.items())}
    return result


def run_fuzz(config: FuzzConfig, on_input: Callable[[int], None] | None = None) -> dict:
    """Start kvloopd and the good agents, fuzz, then check health and the invariants."""
    with fuzz_target(config.listen, config.store) as (process, address, tokens, workdir):
        with (
            GoodAgents(address, tokens) as agents,
            DirectoryClient(address, ClientSecurity(token=tokens.admin)) as client,
        ):
            baseline = observe_good(client)
            result = fuzz_daemon(address, tokens, process, config, on_input)
            alive = process.poll() is None
            channel = grpc.insecure_channel(address)
            healthy = alive and health_ok(channel)
            channel.close()
            if not healthy:
                result.crashes = max(result.crashes, 1)
                log = (workdir / "kvloopd.log").read_text()[-4000:]
                result.invariant_violations.append(f"daemon not serving after the run; log tail:\n{log}")
            else:
                result.invariant_violations.extend(check_invariants(client, baseline))
                sessions = agents.sessions()
                result.good_agent_reconnects = sum(n - 1 for _, n in sessions.values())
                if not all(connected for connected, _ in sessions.values()):
                    result.invariant_violations.append(f"a good agent is not connected: {sessions}")
            internal = [
                line
                for line in (workdir / "kvloopd.log").read_text().splitlines()
                if '"level": "error"' in line
            ]
    out = asdict(result)
    out["store"] = "memory" if config.store == "memory" else "redis"
    out["daemon_errors_logged"] = len(internal)
    out["daemon_error_samples"] = internal[:5]
    return out


__all__ = [
    "FuzzConfig",
    "FuzzResult",
    "cases",
    "connect_scripts",
    "fuzz_target",
    "run_fuzz",
    "unary_requests",
]
