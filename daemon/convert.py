"""Protocol <-> domain conversion for kvloopd, with the validation that refuses bad input.

Every ``kvloop.v1`` message built from the directory's domain types (answers, plans, estimates,
worker listings) is built here, and every request and event is read and checked here, so the policy,
the cost model, the plans and the stores work on domain types only. The RPC handlers (service.py,
session.py) put together their small replies and stream control messages themselves; the cost model
reads the fields of a TransferReport this module's session has accepted. A message that fails validation
raises :class:`BadInput` (INVALID_ARGUMENT) or :class:`Refused` (another status) and changes
nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import grpc
from msgspec import structs

from kvloop.common import block_digests, block_hash
from kvloop.common.addresses import parse_host_port
from kvloop.common.block_keys import KEY_BYTES, block_keys, packed_keys
from kvloop.common.outcomes import tier_name
from kvloop.common.packed_ids import pack_u32, unpack_u32
from kvloop.daemon.cost_model import Cost, Estimates
from kvloop.daemon.index import (
    BlockTier,
    Cleared,
    Event,
    Holding,
    LeaseState,
    Location,
    Namespace,
    PackedHashes,
    Released,
    Removed,
    Retained,
    Stored,
    WorkerSpec,
    WorkerView,
)
from kvloop.daemon.layout import KvLayout
from kvloop.daemon.queries import Answer, LookupQuery, RouteCandidate, RouteQuery, RouteScore
from kvloop.v1 import directory_pb2 as pb

MAX_ID_LENGTH = 256
MAX_TOKENS = 2**32 - 1  # LookupResponse's token counts are uint32


class BadInput(Exception):
    """A message that is refused: INVALID_ARGUMENT with this text, counted under `reason`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EventRefused(Exception):
    """One event of a batch that is left out while the rest of the batch is applied (the stream stays
    up): counted under `reason` in kvloop_rejected_messages_total, with this text in the log."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Refused(Exception):
    """A request refused with a status other than INVALID_ARGUMENT."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_hashes(
    hashes: Sequence[bytes], width: int, limit: int, where: str, registered: bool = True
) -> None:
    if not hashes:
        raise BadInput("empty", f"{where}: no block hashes")
    if len(hashes) > limit:
        raise BadInput("too_many_hashes", f"{where}: {len(hashes)} block hashes exceed the limit of {limit}")
    lengths = set(map(len, hashes))
    if lengths != {width}:
        bad = sorted(lengths - {width})
        raise BadInput(
            "hash_length",
            f"{where}: block hashes must be {width} bytes "
            f"({'registered hash_length' if registered else 'all of one length'}), got lengths {bad}",
        )


# ---- registration -------------------------------------------------------------------------------


def _root_key(root: bytes, width: int, where: str) -> bytes | None:
    """A chain root's block key (None when the agent sent none)."""
    if not root:
        return None
    if len(root) != width:
        raise BadInput("hash_length", f"{where}: root_block_hash must be {width} bytes, got {len(root)}")
    return block_keys([root])[0]


def _root(stored: pb.BlocksStored, keys: Sequence[bytes], width: int, where: str) -> bytes | None:
    """Where a stored chain starts: the root the agent named, its own first block, or not known."""
    if stored.root_block_hash:
        return _root_key(stored.root_block_hash, width, where)
    return None if stored.parent_block_hash else keys[0]


def _event_keys(packed: bytes, listed: Sequence[bytes], width: int, limit: int, where: str) -> PackedHashes:
    """An event's block hashes (packed, or one field per hash from an older agent) as their keys,
    cut in one strided copy: no Python work per block."""
    if packed:
        if len(listed):
            raise BadInput("hashes", f"{where}: give block_hashes or packed_block_hashes, not both")
        n, rest = divmod(len(packed), width)
        if rest:
            raise BadInput(
                "hash_length",
                f"{where}: packed_block_hashes is {len(packed)} bytes, not a multiple of hash_length {width}",
            )
        if n > limit:
            raise BadInput("too_many_hashes", f"{where}: {n} block hashes exceed the limit of {limit}")
        return PackedHashes(packed_keys(packed, width), KEY_BYTES)
    hashes = list(listed)
    check_hashes(hashes, width, limit, where)
    return PackedHashes(packed_keys(b"".join(hashes), width), KEY_BYTES)


def spec_from_registration(reg: pb.WorkerRegistration) -> WorkerSpec:
    problems = []
    if not reg.worker_id or len(reg.worker_id) > MAX_ID_LENGTH:
        problems.append(f"worker_id must be 1-{MAX_ID_LENGTH} characters")
    if reg.role not in (pb.WORKER_ROLE_PREFILL, pb.WORKER_ROLE_DECODE, pb.WORKER_ROLE_BOTH):
        # proto3 enums are open: an unknown number parses and must be refused here, not later.
        problems.append(f"role must be PREFILL, DECODE or BOTH, got {reg.role}")
    if not reg.model:
        problems.append("model must be set")
    if reg.block_size == 0:
        problems.append("block_size must be > 0")
    if not reg.hash_algorithm:
        problems.append("hash_algorithm must be set (e.g. sha256_cbor)")
    if not 8 <= reg.hash_length <= 64:
        problems.append(f"hash_length must be 8..64 bytes, got {reg.hash_length}")
    if reg.epoch == 0:
        problems.append("epoch must be non-zero (new on every agent restart)")
    if reg.role in (pb.WORKER_ROLE_DECODE, pb.WORKER_ROLE_BOTH) and not reg.nixl_endpoint:
        problems.append("nixl_endpoint must be set for a decode worker (pullers connect to it)")
    problems += _host_pool_problems(reg)
    if problems:
        raise BadInput("registration", "invalid registration: " + "; ".join(problems))
    p = reg.parallel
    return WorkerSpec(
        worker_id=reg.worker_id,
        role=reg.role,
        model=reg.model,
        engine_id=reg.engine_id,
        nixl_endpoint=reg.nixl_endpoint,
        block_size=reg.block_size,
        hash_algorithm=reg.hash_algorithm,
        hash_length=reg.hash_length,
        epoch=reg.epoch,
        kv_bytes_per_block=reg.kv_bytes_per_block,
        http_endpoint=reg.http_endpoint,
        parallel=(
            p.tensor_parallel_size or 1,
            p.pipeline_parallel_size or 1,
            p.data_parallel_size or 1,
            p.data_parallel_rank,
        ),
        labels=dict(reg.labels),
        kv_dtype=reg.kv_dtype,
        kv_group_windows=tuple(reg.kv_group_windows),
        hash_seed=reg.hash_seed,
        host_engine_id=reg.host_engine_id,
        host_nixl_endpoint=reg.host_nixl_endpoint,
        agent_version=reg.agent_version,
    )


def _host_pool_problems(reg: pb.WorkerRegistration) -> list[str]:
    """A host pool is named by both its engine id and its side channel, or not at all."""
    if not reg.host_engine_id and not reg.host_nixl_endpoint:
        return []
    if not reg.host_engine_id or not reg.host_nixl_endpoint:
        return ["host_engine_id and host_nixl_endpoint name the host pool together: give both or neither"]
    problems = []
    try:
        parse_host_port(reg.host_nixl_endpoint, "host_nixl_endpoint")
    except ValueError as exc:
        problems.append(str(exc))
    if reg.host_engine_id == reg.engine_id:
        problems.append(
            f"host_engine_id must differ from engine_id ({reg.engine_id!r}): the host pool is a NIXL "
            "engine of its own"
        )
    return problems


def registration_of(spec: WorkerSpec) -> pb.WorkerRegistration:
    tp, pp, dp, rank = spec.parallel
    return pb.WorkerRegistration(
        worker_id=spec.worker_id,
        role=spec.role,
        model=spec.model,
        engine_id=spec.engine_id,
        nixl_endpoint=spec.nixl_endpoint,
        block_size=spec.block_size,
        hash_algorithm=spec.hash_algorithm,
        hash_length=spec.hash_length,
        epoch=spec.epoch,
        kv_bytes_per_block=spec.kv_bytes_per_block,
        http_endpoint=spec.http_endpoint,
        labels=spec.labels,
        kv_dtype=spec.kv_dtype,
        kv_group_windows=spec.kv_group_windows,
        hash_seed=spec.hash_seed,
        host_engine_id=spec.host_engine_id,
        host_nixl_endpoint=spec.host_nixl_endpoint,
        agent_version=spec.agent_version,
        parallel=pb.ParallelLayout(
            tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, data_parallel_rank=rank
        ),
    )


def worker_info(view: WorkerView, prefill_tokens_per_s: float) -> pb.WorkerInfo:
    return pb.WorkerInfo(
        registration=registration_of(view.spec),
        lease_state=int(view.state),
        connected=view.connected,
        last_applied_sequence=view.last_applied_sequence,
        stored_blocks=view.stored_blocks,
        retained_blocks=view.retained_blocks,
        retained_runs=view.retained_runs,
        last_seen_ms_ago=int(view.last_seen_s_ago * 1000),
        events_ingested=view.events_ingested,
        resyncs=view.resyncs,
        prefill_tokens_per_second=prefill_tokens_per_s,
    )


# ---- event batches ------------------------------------------------------------------------------

# Events that count once, not once per block hash, in kvloop_block_events_ingested_total.
_COUNTED_ONCE = ("transfer", "prefill", "released", "cleared")


@dataclass(slots=True)
class BatchEvents:
    """A validated batch: the directory events, the telemetry events (for the cost model), counts per
    kind, and the events left out (well-formed, but not servable from this worker)."""

    events: list[Event] = field(default_factory=list)
    telemetry: list[pb.BlockEvent] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    refused: list[EventRefused] = field(default_factory=list)


def events_from_batch(batch: pb.EventBatch, spec: WorkerSpec, max_hashes: int) -> BatchEvents:
    """Validate the whole batch before anything is applied: a bad batch changes nothing.

    A well-formed event the directory cannot serve (a run of a tier the worker registered no engine
    for) is left out and named in ``refused``; the rest of the batch is applied as usual."""
    width = spec.hash_length
    out = BatchEvents()
    events, telemetry, counts = out.events, out.telemetry, out.counts
    for position, event in enumerate(batch.events):
        kind = event.WhichOneof("event")
        where = f"batch {batch.sequence} event {position} ({kind})"
        if kind == "retained":
            try:
                events.append(_retained(event.retained, spec, max_hashes, where))
            except EventRefused as refused:
                out.refused.append(refused)
                continue
        elif kind == "stored":
            stored = event.stored
            keys = _event_keys(stored.packed_block_hashes, stored.block_hashes, width, max_hashes, where)
            events.append(Stored(keys, stored.lora_name, stored.tier, _root(stored, keys, width, where)))
        elif kind == "removed":
            removed = event.removed
            keys = _event_keys(removed.packed_block_hashes, removed.block_hashes, width, max_hashes, where)
            packed_roots = removed.packed_root_block_hashes
            roots = None
            if packed_roots or len(removed.root_block_hashes):
                roots = _event_keys(packed_roots, removed.root_block_hashes, width, max_hashes, where)
                if roots.n != keys.n:
                    raise BadInput("roots", f"{where}: {roots.n} root_block_hashes for {keys.n} block hashes")
            events.append(Removed(keys, removed.lora_name, roots))
        elif kind == "released":
            if not event.released.retention_handle:
                raise BadInput("handle", f"{where}: retention_handle must be set")
            events.append(Released(event.released.retention_handle))
        elif kind == "cleared":
            events.append(Cleared())
        elif kind in ("transfer", "prefill"):
            telemetry.append(event)
        else:
            raise BadInput("empty", f"{where}: event carries nothing")
        if kind in _COUNTED_ONCE:
            counts[kind] = counts.get(kind, 0) + 1
        else:
            counts[kind] = counts.get(kind, 0) + len(getattr(events[-1], "hashes", ()))
    return out


def _retained(r: pb.BlocksRetained, spec: WorkerSpec, max_hashes: int, where: str) -> Retained:
    keys = _event_keys(r.packed_block_hashes, r.block_hashes, spec.hash_length, max_hashes, where)
    groups = r.num_groups or 1
    packed_ids = r.packed_block_ids
    if packed_ids and len(r.block_ids):
        raise BadInput("block_ids", f"{where}: give block_ids or packed_block_ids, not both")
    ids = packed_ids if packed_ids else pack_u32(r.block_ids)
    if len(ids) != keys.n * groups * 4:
        raise BadInput(
            "block_ids", f"{where}: {len(ids) / 4:g} block_ids for {keys.n} hashes x {groups} groups"
        )
    if not r.retention_handle:
        raise BadInput("handle", f"{where}: retention_handle must be set")
    if r.expires_in_ms == 0:
        raise BadInput("expiry", f"{where}: expires_in_ms must be > 0")
    if r.tail_token_ids or r.tail_block_ids:
        if not 0 < len(r.tail_token_ids) < spec.block_size:
            raise BadInput(
                "tail",
                f"{where}: {len(r.tail_token_ids)} tail_token_ids; a partly filled block holds "
                f"1 to {spec.block_size - 1}",
            )
        if len(r.tail_block_ids) != groups:
            raise BadInput("tail", f"{where}: {len(r.tail_block_ids)} tail_block_ids for {groups} groups")
    digests = r.block_digests
    if digests:
        try:
            block_digests.check_run(digests, groups, keys.n, bool(r.tail_token_ids))
        except ValueError as exc:
            raise BadInput("block_digests", f"{where}: {exc}") from None
    tier = r.tier or BlockTier.DEVICE
    if tier == BlockTier.HOST and not spec.host_nixl_endpoint:
        raise EventRefused(
            "no_host_pool",
            f"{where}: run {r.retention_handle!r} is in host memory, but worker {spec.worker_id!r} "
            "registered no host pool (host_engine_id, host_nixl_endpoint) to read it from: not indexed",
        )
    if tier not in (BlockTier.DEVICE, BlockTier.HOST):
        raise EventRefused(
            "unservable_tier",
            f"{where}: run {r.retention_handle!r} is in tier {tier_name(tier)!r}; only device and host "
            "runs can be read: not indexed",
        )
    return Retained(
        keys,
        ids,
        groups,
        r.retention_handle,
        r.expires_in_ms,
        r.single_use,
        r.lora_name,
        tier,
        list(r.tail_token_ids),
        list(r.tail_block_ids),
        r.registration_generation,
        digests,
    )


# ---- Lookup -------------------------------------------------------------------------------------


def _prompt_hashes(
    request: pb.LookupRequest | pb.RouteRequest, model_spec: WorkerSpec | None, max_hashes: int, rpc: str
) -> tuple[PackedHashes, int]:
    """The prompt's block hashes (as keys), checked against the model's layout, and the block size."""
    width = model_spec.hash_length if model_spec else 0
    block_size = model_spec.block_size if model_spec else request.block_size
    packed = request.packed_block_hashes  # read once: each access copies the bytes out of the message
    if packed and len(request.block_hashes):
        raise BadInput("hashes", "give block_hashes or packed_block_hashes, not both")
    hashes: PackedHashes
    if packed:
        declared = request.packed_hash_bytes or width  # 0: a model nobody registered yet
        if declared and not KEY_BYTES <= declared <= (width or declared):
            raise BadInput(
                "packed_hash_bytes",
                f"packed_hash_bytes must be {KEY_BYTES}..{width or 'hash_length'} (0: the model's "
                f"hash_length), got {declared}",
            )
        if declared and len(packed) % declared:
            raise BadInput(
                "hash_length",
                f"packed_block_hashes is {len(packed)} bytes, not a multiple of "
                + (
                    f"packed_hash_bytes {declared}"
                    if request.packed_hash_bytes
                    else f"the model's hash_length {declared}"
                ),
            )
        step = declared or 32  # an unregistered model's prompt finds nothing; read it as sha256
        if len(packed) // step > max_hashes:
            raise BadInput(
                "too_many_hashes", f"{len(packed) // step} block hashes exceed the limit of {max_hashes}"
            )
        hashes = PackedHashes(packed if step == KEY_BYTES else packed_keys(packed, step), KEY_BYTES)
    else:
        listed = list(request.block_hashes)
        if listed:
            # A model nobody registered yet has no hash_length: its hashes must still agree with
            # each other (a store packs them at one width; mixed lengths failed with UNKNOWN).
            check_hashes(listed, width or len(listed[0]), max_hashes, rpc, registered=bool(width))
            if len(listed[0]) < KEY_BYTES:  # only an unregistered model's (hash_length is >= 8)
                raise BadInput("hash_length", f"{rpc}: block hashes must be at least {KEY_BYTES} bytes")
            hashes = PackedHashes(packed_keys(b"".join(listed), len(listed[0])), KEY_BYTES)
        else:
            hashes = PackedHashes(b"", KEY_BYTES)
    if request.block_size and block_size and request.block_size != block_size:
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"model {request.model!r} uses block_size {block_size}; the {rpc.lower()} hashed with "
            f"{request.block_size}: the hashes cannot match",
        )
    if block_size and hashes.n * block_size > MAX_TOKENS:
        # The answer's token counts are uint32: a product past them failed with UNKNOWN.
        raise BadInput(
            "too_many_tokens",
            f"{hashes.n} blocks of {block_size} tokens exceed {MAX_TOKENS} tokens",
        )
    return hashes, block_size or 0


def lookup_query(request: pb.LookupRequest, model_spec: WorkerSpec | None, max_hashes: int) -> LookupQuery:
    """The request as a query; ``model_spec`` is any registered worker of the model (its layout)."""
    model = request.model
    if not model:
        raise BadInput("model", "model must be set")
    hashes, block_size = _prompt_hashes(request, model_spec, max_hashes, "Lookup")
    local_blocks = request.local_blocks
    if local_blocks > hashes.n:
        raise BadInput("local_blocks", f"local_blocks {local_blocks} exceeds the {hashes.n} hashes given")
    p = request.parallel
    return LookupQuery(  # positional: every Lookup builds one
        Namespace(model, request.lora_name),
        hashes,
        local_blocks,
        request.requester_worker_id,
        block_size,
        request.claim,
        request.min_pull_tokens,
        request.lease_margin_ms / 1000.0,
        KvLayout(
            p.tensor_parallel_size,
            p.pipeline_parallel_size,
            request.kv_dtype,
            request.kv_bytes_per_block,
            tuple(request.kv_group_windows),
        ),
    )


def cost_fields(cost: Cost | None) -> dict | None:
    """An estimate as a CostEstimate's fields (the same names), for a message constructor (None: unset)."""
    return None if cost is None else structs.asdict(cost)


def lookup_response(
    answer: Answer, block_size: int, pack_block_ids: bool, read_window_ms: int
) -> pb.LookupResponse:
    """``read_window_ms`` caps each holder's expires_in_ms: how long the puller may read the run."""
    response = pb.LookupResponse(
        decision=answer.decision,
        reason=answer.reason,
        path=answer.path,
        detail=answer.detail,
        matched_blocks=answer.matched_blocks,
        matched_tokens=answer.matched_blocks * block_size,
        recompute_tokens=answer.recompute_blocks * block_size,
        cost=cost_fields(answer.cost),
    )
    match = answer.match
    if match.best is not None:
        _fill_holder(response.holder, match.best, pack_block_ids, read_window_ms)
        for other in match.others:
            _fill_holder(response.other_holders.add(), other, pack_block_ids, read_window_ms)
    return response


def _fill_holder(message: pb.Holder, holding: Holding, packed: bool, read_window_ms: int) -> None:
    spec = holding.worker
    # Fields left at their default are not set (proto3 sends none): every Lookup fills a holder.
    message.worker_id = spec.worker_id
    if holding.tier == BlockTier.HOST:  # read from the worker's host pool, a NIXL engine of its own
        message.engine_id = spec.host_engine_id
        message.nixl_endpoint = spec.host_nixl_endpoint
    else:
        message.engine_id = spec.engine_id
        message.nixl_endpoint = spec.nixl_endpoint
    message.tier = holding.tier
    if spec.http_endpoint:
        message.http_endpoint = spec.http_endpoint
    message.matched_blocks = holding.matched_blocks
    message.retention_handle = holding.handle
    message.expires_in_ms = min(holding.expires_in_ms, read_window_ms)
    if packed:
        message.packed_block_ids = holding.packed_block_ids
    else:
        message.block_ids.extend(holding.block_ids)
    message.num_groups = holding.num_groups
    if holding.single_use:
        message.single_use = True
    if holding.tail_token_ids:
        message.tail_token_ids.extend(holding.tail_token_ids)
        message.tail_block_ids.extend(holding.tail_block_ids)
    message.kv_bytes_per_block = spec.kv_bytes_per_block
    message.epoch = spec.epoch
    if holding.registration_generation:
        message.registration_generation = holding.registration_generation
    if holding.digests:
        message.block_digests = holding.digests
    message.tensor_parallel_size = spec.parallel[0]


def block_location(loc: Location) -> pb.BlockLocation:
    return pb.BlockLocation(
        worker_id=loc.worker_id,
        kind=loc.kind,
        position=loc.position,
        block_ids=loc.block_ids,
        retention_handle=loc.handle,
        expires_in_ms=loc.expires_in_ms,
        servable=loc.servable,
        tier=loc.tier,
    )


# ---- Route --------------------------------------------------------------------------------------

MAX_ROUTE_CANDIDATES = 256


def _route_tokens(request: pb.RouteRequest, packed: bytes) -> array | None:
    """The prompt's token ids, when the request gives them (either form; ``packed`` is its
    packed_token_ids), as one uint32 array."""
    if packed:
        if len(packed) % 4:
            raise BadInput(
                "packed_token_ids", f"packed_token_ids is {len(packed)} bytes, not a multiple of 4"
            )
        return unpack_u32(packed)
    return array("I", request.token_ids) if len(request.token_ids) else None


def _token_hashes(
    request: pb.RouteRequest,
    tokens: array,
    spec: WorkerSpec,
    max_hashes: int,
    hasher: block_hash.BlockHasher,
) -> list[bytes]:
    if request.lora_name:
        raise BadInput(
            "token_ids",
            "token_ids cannot be hashed for a LoRA request (vLLM hashes the adapter's path, which "
            "kvloopd does not know): send block_hashes",
        )
    if not spec.hash_seed:
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"the workers of model {spec.model!r} registered no hash seed (agents older than Route): "
            "send block_hashes",
        )
    if len(tokens) // spec.block_size > max_hashes:
        raise BadInput("too_many_hashes", f"{len(tokens)} tokens exceed the limit of {max_hashes} blocks")
    try:
        hashes = hasher.hashes(
            tokens, spec.block_size, spec.hash_algorithm, spec.hash_seed, request.cache_salt
        )
    except block_hash.UnsupportedHashing as exc:
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION, f"model {spec.model!r}: {exc}: send block_hashes"
        ) from None
    if hashes and len(hashes[0]) != spec.hash_length:
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"model {spec.model!r} registered {spec.hash_length}-byte hashes; kvloopd computes "
            f"{len(hashes[0])}-byte digests: send block_hashes",
        )
    return hashes


def route_query(
    request: pb.RouteRequest,
    model_spec: WorkerSpec | None,
    workers: Sequence[WorkerView],
    max_hashes: int,
    hasher: block_hash.BlockHasher,
) -> RouteQuery:
    """The request as a query; ``workers`` are the model's registered workers (candidates are
    resolved among the active ones by worker_id or http_endpoint)."""
    if not request.model:
        raise BadInput("model", "model must be set")
    if not request.candidates:
        raise BadInput("candidates", "no candidates to rank")
    if len(request.candidates) > MAX_ROUTE_CANDIDATES:
        raise BadInput(
            "candidates", f"{len(request.candidates)} candidates exceed the limit of {MAX_ROUTE_CANDIDATES}"
        )
    packed_tokens = request.packed_token_ids  # read once: each access copies the bytes out of the message
    given = sum(
        map(
            bool,
            (len(request.block_hashes), request.packed_block_hashes, len(request.token_ids), packed_tokens),
        )
    )
    if given != 1:
        raise BadInput(
            "hashes", "give exactly one of block_hashes, packed_block_hashes, token_ids or packed_token_ids"
        )
    tokens = _route_tokens(request, packed_tokens)
    if request.cache_salt and tokens is None:
        raise BadInput("cache_salt", "cache_salt only applies to token ids (block hashes already include it)")
    hashes: Sequence[bytes]
    if tokens is not None:
        if model_spec is None:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no worker of model {request.model!r} is registered: its block size and hashing are unknown",
            )
        if request.block_size and request.block_size != model_spec.block_size:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"model {request.model!r} uses block_size {model_spec.block_size}, the route asked "
                f"{request.block_size}",
            )
        hashes = block_keys(_token_hashes(request, tokens, model_spec, max_hashes, hasher))
        block_size = model_spec.block_size
        prompt_tokens = request.prompt_tokens or len(tokens)
    else:
        hashes, block_size = _prompt_hashes(request, model_spec, max_hashes, "Route")
        prompt_tokens = request.prompt_tokens or len(hashes) * block_size
    if prompt_tokens < len(hashes) * block_size:
        raise BadInput(
            "prompt_tokens",
            f"prompt_tokens {prompt_tokens} is shorter than the {len(hashes)} full blocks given",
        )
    by_id = {v.spec.worker_id: v for v in workers}
    by_http = {v.spec.http_endpoint.rstrip("/"): v for v in workers if v.spec.http_endpoint}
    candidates = []
    for position, c in enumerate(request.candidates):
        if bool(c.worker_id) == bool(c.http_endpoint):
            raise BadInput(
                "candidates", f"candidate {position}: give worker_id or http_endpoint (one of them)"
            )
        view = by_id.get(c.worker_id) if c.worker_id else by_http.get(c.http_endpoint.rstrip("/"))
        active = view is not None and view.state == LeaseState.ACTIVE
        candidates.append(
            RouteCandidate(
                worker_id=view.spec.worker_id if view is not None else c.worker_id,
                http_endpoint=c.http_endpoint or (view.spec.http_endpoint if view is not None else ""),
                spec=view.spec if active and view is not None else None,
                in_flight_requests=c.in_flight_requests,
                queued_tokens=c.queued_tokens,
            )
        )
    return RouteQuery(
        namespace=Namespace(request.model, request.lora_name),
        hashes=hashes,
        block_size=block_size,
        prompt_tokens=prompt_tokens,
        candidates=candidates,
    )


def plan_response(
    score: RouteScore,
    hashes: Sequence[bytes],
    block_size: int,
    continuation: bool,
    directory_epoch: int,
    read_window_ms: int,
) -> pb.PlansResponse:
    """A pull Route planned for one candidate, as its subscribed connector receives it."""
    assert score.plan is not None
    lookup = lookup_response(score.plan, block_size, pack_block_ids=True, read_window_ms=read_window_ms)
    lookup.directory_epoch = directory_epoch
    return pb.PlansResponse(
        prompt_key=hashes[-1],
        prompt_blocks=len(hashes),
        local_blocks=score.local_blocks,
        lookup=lookup,
        continuation=continuation,
    )


def pairs_response(estimates: Estimates, keep: set[str] | None = None) -> pb.ListPairsResponse:
    """The cost model's estimates; with ``keep``, only pairs and pullers of those workers."""
    pairs = [
        p for p in estimates.pairs if keep is None or p.holder_worker_id in keep or p.puller_worker_id in keep
    ]
    pullers = [p for p in estimates.pullers if keep is None or p.worker_id in keep]
    return pb.ListPairsResponse(
        pairs=[pb.PairEstimate(**asdict(p)) for p in pairs],
        pullers=[pb.PullerEstimate(**asdict(p)) for p in pullers],
    )


def route_response(query: RouteQuery, ranked: Sequence[RouteScore], tied: int) -> pb.RouteResponse:
    response = pb.RouteResponse(
        tied=tied,
        prompt_blocks=len(query.hashes),
        prompt_tokens=query.prompt_tokens,
        block_size=query.block_size,
    )
    for score in ranked:
        c = score.candidate
        response.ranked.add(
            worker_id=c.worker_id,
            http_endpoint=c.http_endpoint,
            registered=c.spec is not None,
            local_blocks=score.local_blocks,
            pull_blocks=score.pull_blocks,
            pull_holder_worker_id=score.pull_holder,
            pull_holder_blocks=score.pull_holder_blocks,
            pull_holder_tier=score.pull_holder_tier,
            pull_reason=score.pull_reason,
            compute_tokens=score.compute_tokens,
            queue_ms=score.queue_ms,
            transfer_ms=score.transfer_ms,
            pull_wait_ms=score.pull_wait_ms,
            compute_ms=score.compute_ms,
            expected_ttft_ms=score.expected_ttft_ms,
            prefill_tokens_per_s=score.prefill_tokens_per_s,
            prefill_basis=score.prefill_basis,
            pull_cost=cost_fields(score.pull_cost),
        )
    return response
