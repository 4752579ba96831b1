"""The host retention pool's NIXL descriptors against each supported vLLM release's own descriptor
code (vLLM and NIXL installed, no engines).

vLLM 0.32.0 is the installed CPU build: its worker methods are called as they are. vLLM 0.33.0 exists
only as a GPU wheel, so its methods are read from that wheel (the one ``make vllm-compat`` caches) and
executed on stand-in workers: nothing of 0.33 is installed or imported. For each release:

* the pool's descriptors are those the release builds for a KV cache laid out like the pool
  (``_build_fa_local``), and those its pull code builds from the pool's handshake (``_build_fa_remote``);
* vLLM's descriptor ids (``_compute_desc_ids``) pick each slot's bytes out of them;
* a copy into the pool (a real NIXL WRITE, :meth:`HostPool.start`) and a prefill's READ out of it, both
  by those ids, move the KV cache's bytes exactly.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")
torch = pytest.importorskip("torch")

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (  # noqa: E402
    NixlBaseConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (  # noqa: E402
    NixlAgentMetadata,
    NixlHandshakePayload,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import compute_tp_mapping  # noqa: E402
from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from kvloop.agents.connector import compat  # noqa: E402
from kvloop.agents.connector.host.pool import HostPool  # noqa: E402
from kvloop.agents.connector.metadata import HostCopy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NIXL_PKG = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
# The NixlBaseConnectorWorker methods run here, in each release's version.
WORKER_METHODS = (
    "_build_fa_local",
    "_build_fa_remote",
    "_compute_desc_ids",
    "_is_region_replicated",
    "register_local_xfer_handler",
)
DESCRIPTOR_FORMS = {"0.32.0": ("_stack_descs",), "0.33.0": ("_pack_strided_descs", "_block_strided_descs")}

BS = 16
# Three KV-cache regions of different block lengths; two of them pad their blocks (stride > length),
# as some layouts do. The pool holds each region's blocks back to back.
BLOCK_LENS = [256, 384, 256]
KV_STRIDES = [256, 512, 320]
KV_BLOCKS = 10
SLOTS = 6
PREFILL_BLOCKS = 8


# --------------------------------------------------------------------------- each release's code


@dataclass
class Release:
    version: str
    worker_code: type  # holds the release's NixlBaseConnectorWorker methods
    compute_tp_mapping: Callable[..., Any]

    @property
    def strided(self) -> bool:
        return self.version == "0.33.0"

    def worker(self, **state: Any) -> Any:
        """A stand-in worker: the release's methods over the given state."""
        worker = object.__new__(self.worker_code)
        worker.__dict__.update(state)
        return worker

    def prep_remote(self, wrapper: Any, agent_name: str, descs: np.ndarray) -> Any:
        """What the release's ``add_remote_agent`` does with the descriptors ``_build_fa_remote`` gave."""
        if self.strided:
            return wrapper.prep_xfer_dlist(agent_name, descs, mem_type="DRAM")
        return wrapper.prep_xfer_dlist(agent_name, wrapper.get_xfer_descs(descs, "DRAM"))


def _installed_release() -> Release:
    names = (*WORKER_METHODS, *DESCRIPTOR_FORMS["0.32.0"])
    code = type("NixlWorkerCode032", (), {n: NixlBaseConnectorWorker.__dict__[n] for n in names})
    return Release("0.32.0", code, compute_tp_mapping)


def _vllm_compat_script() -> ModuleType:
    name = "kvloop_scripts_vllm_compat"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "vllm_compat.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def _exec_module(source: Any, module: str, as_name: str) -> ModuleType:
    """Run one module of a release's source under another name; its imports resolve in the installed
    vLLM (only for modules whose vLLM imports are the same in both)."""
    tree = source.tree(module)
    assert tree is not None, module
    loaded = ModuleType(as_name)
    sys.modules[as_name] = loaded
    exec(compile(tree, f"<vLLM {source.release}: {module}>", "exec"), loaded.__dict__)
    return loaded


def _free_names(fn: ast.FunctionDef) -> set[str]:
    body = ast.Module(body=fn.body, type_ignores=[])
    args = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
    names = [n for n in ast.walk(body) if isinstance(n, ast.Name)]
    stored = {n.id for n in names if isinstance(n.ctx, ast.Store)}
    return {n.id for n in names if isinstance(n.ctx, ast.Load)} - stored - args - set(dir(builtins))


def _wheel_source(version: str) -> Any:
    """The release's wheel, read in place (``make vllm-compat``'s cache; fetched when missing)."""
    script = _vllm_compat_script()
    try:
        wheel = script.fetch_wheel(version, ROOT / ".cache" / "vllm-wheels", [sys.executable, "-m", "pip"])
    except RuntimeError as exc:
        pytest.skip(f"vLLM {version}'s wheel is not cached and cannot be fetched: {exc}")
    return script.Source(version, wheel)


def _wheel_release(version: str) -> Release:
    """The release's worker methods, read from its wheel and compiled into a class of their own; each
    name they use is bound as the release's module binds it (its constants, its TP mapping module, the
    installed vLLM for KV-cache spec classes)."""
    source = _wheel_source(version)
    tag = version.replace(".", "_")
    tp_mapping = _exec_module(source, f"{NIXL_PKG}.tp_mapping", f"kvloop_tests_vllm_{tag}_tp_mapping")
    module = f"{NIXL_PKG}.base_worker"
    tree = source.tree(module)
    assert tree is not None
    (worker_class,) = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "NixlBaseConnectorWorker"
    ]
    wanted = (*WORKER_METHODS, *DESCRIPTOR_FORMS[version])
    methods = [n for n in worker_class.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert sorted(m.name for m in methods) == sorted(wanted)
    namespace: dict[str, Any] = {"__name__": f"kvloop_tests_vllm_{tag}_base_worker"}
    for name in set().union(*(_free_names(m) for m in methods)):
        namespace[name] = _module_binding(tree, name, tp_mapping, module)
    code = "from __future__ import annotations\n\n\nclass NixlWorkerCode:\n" + "\n".join(
        "    " + line for m in methods for line in (ast.unparse(m) + "\n").splitlines()
    )
    exec(compile(code, f"<vLLM {version}: {module}.NixlBaseConnectorWorker>", "exec"), namespace)
    worker_code = namespace["NixlWorkerCode"]
    worker_code.__name__ = f"NixlWorkerCode{tag}"
    return Release(version, worker_code, tp_mapping.compute_tp_mapping)


def _module_binding(tree: ast.Module, name: str, tp_mapping: ModuleType, module: str) -> Any:
    """What ``name`` is bound to in the release's ``module``: its own constant, a function of its TP
    mapping module (run from the same release), or a class the installed vLLM defines alike."""
    if name == "logger":
        return logging.getLogger(module)
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return importlib.import_module(alias.name)
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            (alias,) = [a for a in node.names if (a.asname or a.name) == name]
            if node.module == f"{NIXL_PKG}.tp_mapping":
                return getattr(tp_mapping, alias.name)
            return getattr(importlib.import_module(node.module or ""), alias.name)
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                assert node.value is not None
                return ast.literal_eval(node.value)
    raise AssertionError(f"{module} does not bind {name}")


@pytest.fixture(scope="module", params=["0.32.0", "0.33.0"])
def release(request) -> Release:
    return _installed_release() if request.param == "0.32.0" else _wheel_release(request.param)


# --------------------------------------------------------------------------- a decode and its pool


def _agent(name: str) -> Any:
    return NixlWrapper(name, nixl_agent_config(enable_prog_thread=False, num_threads=1))


def _regions(buffers: list[torch.Tensor], strides: list[int]) -> list[torch.Tensor]:
    """Each region's blocks, one row each, cut to the block's length."""
    return [b.view(-1, s)[:, :n] for b, s, n in zip(buffers, strides, BLOCK_LENS, strict=True)]


def _handshake(engine_id: str, agent: Any, bases: list[int], blocks: int, strides: list[int]) -> Any:
    meta = NixlAgentMetadata(
        engine_id=engine_id,
        agent_metadata=agent.get_agent_metadata(),
        kv_caches_base_addr=bases,
        device_id=0,
        num_blocks=blocks,
        block_lens=list(BLOCK_LENS),
        block_strides=strides,
        kv_cache_layout="NHD",
        block_size=BS,
        ssm_sizes=(0, 0),
        attn_backend_name="CPU_ATTN",
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[blocks] * len(bases),
        region_group_ids=[0] * len(bases),
        region_names=[f"model.layers.{i}.self_attn.attn" for i in range(len(bases))],
        region_mem_types=["DRAM"] * len(bases),
    )
    return NixlHandshakePayload(compatibility_hash="same", agent_metadata_bytes=msgspec.msgpack.encode(meta))


def _worker_state(engine_id: str, agent: Any, bases: list[int], blocks: int, strides: list[int]) -> dict:
    """What the methods run here read of a worker, as vLLM sets it for a one-group KV cache."""
    regions = len(bases)
    return {
        "engine_id": engine_id,
        "vllm_config": SimpleNamespace(
            parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
        ),
        "tp_rank": 0,
        "world_size": 1,
        "device_id": 0,
        "transfer_topo": TransferTopology(
            tp_rank=0,
            tp_size=1,
            block_size=BS,
            engine_id=engine_id,
            is_mla=False,
            is_mamba=False,
            total_num_kv_heads=8,
            attn_backends=[],
        ),
        "block_size": BS,
        "num_blocks": blocks,
        "num_regions": regions,
        "block_len_per_layer": list(BLOCK_LENS),
        "block_stride_per_layer": strides,
        "region_num_blocks": [blocks] * regions,
        "region_group_ids": [0] * regions,
        "_uses_region_group_mapping": False,
        "region_mem_types": ["DRAM"] * regions,
        "kv_caches_base_addr": {engine_id: {0: bases}},
        "_transfer_layer_region_indices": (),
        "_transfer_layer_group_ids": (),
        "_group_spec_types": (FullAttentionSpec,),
        "_region_is_mla": [False] * regions,
        "_head_sharded_draft_regions": set(),
        "_has_mamba": False,
        "_conv_decomp": None,
        "_ssm_region_indices": [],
        "use_host_buffer": False,
        "_mixed_mem_types": False,
        "_physical_blocks_per_logical_kv_block": 1,
        "nixl_wrapper": agent,
        "nixl_backends": ["UCX"],
        "src_xfer_handles_by_block_size": {},
    }


@dataclass
class Side:
    """One engine's stand-in worker, its NIXL agent and its KV cache."""

    worker: Any
    agent: Any
    buffers: list[torch.Tensor]
    strides: list[int]
    reg: Any

    @property
    def blocks(self) -> list[torch.Tensor]:
        return _regions(self.buffers, self.strides)


def _side(release: Release, engine_id: str, blocks: int, strides: list[int], fill: bool) -> Side:
    agent = _agent(f"{engine_id}-{release.version}")
    buffers = [torch.zeros(blocks * s, dtype=torch.uint8) for s in strides]
    if fill:
        for b in buffers:
            b.random_(0, 256)
    bases = [int(b.data_ptr()) for b in buffers]
    reg = agent.get_reg_descs([(b, blocks * s, 0, "") for b, s in zip(bases, strides, strict=True)], "DRAM")
    agent.register_memory(reg, backends=["UCX"])
    worker = release.worker(**_worker_state(engine_id, agent, bases, blocks, strides))
    worker.xfer_handshake_metadata = _handshake(engine_id, agent, bases, blocks, strides)
    # The release's own registration of the KV cache's local descriptors.
    handle, worker.src_blocks_data = worker.register_local_xfer_handler(BS)
    worker.src_xfer_handles_by_block_size[BS] = handle
    return Side(worker, agent, buffers, strides, reg)


@pytest.fixture
def decode(release: Release, monkeypatch) -> Iterator[SimpleNamespace]:
    """A decode's KV cache (random bytes) and its host pool, on the release's descriptor code."""
    monkeypatch.setattr(compat, "STRIDED_DESCRIPTORS", release.strided)
    side = _side(release, "decode-0", KV_BLOCKS, list(KV_STRIDES), fill=True)
    pool = HostPool(side.worker, SLOTS)
    meta = msgspec.msgpack.decode(pool.handshake.agent_metadata_bytes, type=NixlAgentMetadata)
    yield SimpleNamespace(release=release, side=side, pool=pool, meta=meta)
    pool.shutdown()
    side.agent.deregister_memory(side.reg)


def _expanded(descs: np.ndarray) -> np.ndarray:
    """One (address, length) row per block, whichever form ``descs`` has."""
    if descs.shape[1] == 3:
        return descs[:, :2]
    rows = [
        np.stack([addr + np.arange(count, dtype=np.uint64) * stride, np.full(count, length, np.uint64)], 1)
        for addr, length, _, stride, count in descs
    ]
    return np.concatenate(rows)


def _wait(done: Callable[[], bool], what: str, poll: Callable[[], Any]) -> None:
    deadline = time.monotonic() + 10
    while not done():
        assert time.monotonic() < deadline, f"{what} did not end"
        poll()
        time.sleep(0.001)


# --------------------------------------------------------------------------- the tests


def test_the_pools_descriptors_are_the_releases_own_for_a_kv_cache_laid_out_like_it(decode):
    release, pool, meta = decode.release, decode.pool, decode.meta
    rows = SLOTS + 1
    pool_like = release.worker(
        **{
            **_worker_state("pool", None, meta.kv_caches_base_addr, rows, list(BLOCK_LENS)),
            "region_num_blocks": [rows] * len(BLOCK_LENS),
        }
    )
    own = pool_like._build_fa_local(meta.kv_caches_base_addr, 1)
    assert pool.pool_descs.dtype == own.dtype == np.uint64
    np.testing.assert_array_equal(pool.pool_descs, own)
    if release.strided:  # one strided row per region: address, length, device, stride, count
        assert pool.pool_descs.shape == (len(BLOCK_LENS), 5)
        assert [list(r) for r in pool.pool_descs[:, 1:]] == [[n, 0, n, rows] for n in BLOCK_LENS]
    else:
        assert pool.pool_descs.shape == (len(BLOCK_LENS) * rows, 3)


def test_a_prefills_pull_code_describes_the_pool_as_the_pool_does(decode):
    """What the prefill's vLLM builds from the pool's handshake to READ it (``add_remote_agent``) is
    exactly the list the decode WRITEs through."""
    release, pool, meta = decode.release, decode.pool, decode.meta
    assert meta.engine_id == "decode-0@host" and meta.num_blocks == SLOTS + 1
    assert meta.block_strides == meta.block_lens == BLOCK_LENS  # dense
    assert meta.region_num_blocks == [SLOTS + 1] * len(BLOCK_LENS)
    assert meta.region_mem_types == ["DRAM"] * len(BLOCK_LENS)
    prefill = release.worker(**_worker_state("prefill-0", None, [0, 0, 0], PREFILL_BLOCKS, list(BLOCK_LENS)))
    plan = release.compute_tp_mapping(prefill.transfer_topo, 1, prefill._group_spec_types)
    np.testing.assert_array_equal(prefill._build_fa_remote(plan, meta, 1), pool.pool_descs)


def test_descriptor_ids_pick_each_slots_bytes(decode):
    pool, meta = decode.pool, decode.meta
    slots = [[3, 1, 5]]
    ids = pool._desc_ids(slots, SLOTS + 1, pool.region_num_blocks)
    picked = _expanded(pool.pool_descs)[ids]
    want = [
        (base + slot * n, n)
        for base, n in zip(meta.kv_caches_base_addr, BLOCK_LENS, strict=True)
        for slot in slots[0]
    ]
    assert [tuple(int(v) for v in row) for row in picked] == want


def test_a_copy_into_the_pool_and_a_prefills_read_out_of_it_move_the_kv_bytes(decode):
    release, side, pool, meta = decode.release, decode.side, decode.pool, decode.meta
    kv_blocks, slots = [7, 2, 9], [1, 4, 2]
    pool.start(HostCopy("r1@host", block_ids=[kv_blocks], slots=[slots]))
    done: dict[str, bool] = {}
    _wait(
        lambda: "r1@host" in done,
        "the copy into the pool",
        lambda: (pool.poll(), done.update(pool.take_done())),
    )
    assert done == {"r1@host": True}
    for copied, region in zip(pool.read_slots(slots), side.blocks, strict=True):
        assert torch.equal(copied, region[kv_blocks])

    # A prefill reads the slots into its own KV cache, as the release's pull code does (pull_worker).
    prefill = _side(release, "prefill-0", PREFILL_BLOCKS, list(BLOCK_LENS), fill=False)
    try:
        w = prefill.worker
        remote_agent = prefill.agent.add_remote_agent(meta.agent_metadata)
        plan = release.compute_tp_mapping(w.transfer_topo, 1, w._group_spec_types)
        remote = release.prep_remote(prefill.agent, remote_agent, w._build_fa_remote(plan, meta, 1))
        prefill_blocks = [0, 3, 5]
        remote_ids = w._compute_desc_ids(
            block_ids=[slots],
            dst_num_blocks=meta.num_blocks,
            block_size_ratio=None,
            physical_blocks_per_logical=1,
            region_num_blocks=meta.region_num_blocks,
            region_group_ids=meta.region_group_ids,
            uses_region_group_mapping=False,
        )
        local_ids = w._compute_desc_ids(
            block_ids=[prefill_blocks],
            dst_num_blocks=PREFILL_BLOCKS,
            block_size_ratio=1,
            physical_blocks_per_logical=1,
            region_num_blocks=None,
            region_group_ids=w.region_group_ids,
            uses_region_group_mapping=False,
        )
        read = prefill.agent.make_prepped_xfer(
            "READ", w.src_xfer_handles_by_block_size[BS], local_ids, remote, remote_ids, notif_msg=b"r1:1"
        )
        prefill.agent.transfer(read)
        _wait(lambda: prefill.agent.check_xfer_state(read) != "PROC", "the prefill's READ", pool.poll)
        assert prefill.agent.check_xfer_state(read) == "DONE"
        prefill.agent.release_xfer_handle(read)
        for got, region in zip(prefill.blocks, side.blocks, strict=True):
            assert torch.equal(got[prefill_blocks], region[kv_blocks])
    finally:
        prefill.agent.deregister_memory(prefill.reg)


def test_the_handshake_metadata_the_pool_rewrites_is_the_same_in_both_releases():
    """The pool's handshake is this engine's NixlAgentMetadata with its own addresses (decoded and
    encoded with the installed vLLM's classes): the classes are the same in every supported release
    (``make vllm-compat`` checks the fields exist)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    installed = _vllm_compat_script().Source("0.32.0", Path(spec.origin).parents[1])
    wheel = _wheel_source("0.33.0")
    for name in ("NixlAgentMetadata", "NixlHandshakePayload"):
        a, b = (
            next(
                n
                for n in s.tree(f"{NIXL_PKG}.metadata").body
                if isinstance(n, ast.ClassDef) and n.name == name
            )
            for s in (installed, wheel)
        )
        assert ast.dump(a) == ast.dump(b), name
