"""`make vllm-compat`'s checker (scripts/vllm_compat.py) against the installed vLLM's source and against
doctored copies of it: it passes on the real source and names each symbol it cannot find."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NIXL = Path("vllm/distributed/kv_transfer/kv_connector/v1/nixl")


@pytest.fixture(scope="module")
def vllm_tree(tmp_path_factory) -> Path:
    """A copy of the installed vLLM's Python source (nothing imported)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    dst = tmp_path_factory.mktemp("vllm-src")
    shutil.copytree(
        Path(spec.origin).parent,
        dst / "vllm",
        ignore=lambda folder, names: [
            n
            for n in names
            if (not n.endswith(".py") and not (Path(folder) / n).is_dir()) or n == "__pycache__"
        ],
    )
    return dst


def _check(tree: Path, release: str = "0.32.0") -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "vllm_compat.py"),
            "--release",
            release,
            "--source",
            f"{release}={tree}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _doctored(vllm_tree: Path, tmp_path: Path, rel: Path, old: str, new: str) -> Path:
    dst = tmp_path / "doctored"
    shutil.copytree(vllm_tree, dst, copy_function=os.symlink)  # the untouched files: links to the copy
    path = dst / rel
    text = path.read_text()
    assert old in text
    path.unlink()
    path.write_text(text.replace(old, new))
    return dst


def test_the_installed_release_passes(vllm_tree):
    result = _check(vllm_tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "symbols and signatures match" in result.stdout


def test_a_removed_import_is_named(vllm_tree, tmp_path):
    tree = _doctored(vllm_tree, tmp_path, NIXL / "stats.py", "class NixlKVConnectorStats", "class Renamed")
    result = _check(tree)
    assert result.returncode == 1
    assert "nixl.stats has no NixlKVConnectorStats in vLLM 0.32.0" in result.stdout


def test_a_vanished_overridden_method_is_named(vllm_tree, tmp_path):
    tree = _doctored(
        vllm_tree, tmp_path, NIXL / "base_worker.py", "def _pop_done_transfers(", "def _pop_done_xfers("
    )
    result = _check(tree)
    assert result.returncode == 1
    assert "KvloopConnectorWorker calls super()._pop_done_transfers, which vLLM 0.32.0 lacks" in result.stdout


def test_a_changed_signature_is_named(vllm_tree, tmp_path):
    tree = _doctored(
        vllm_tree,
        tmp_path,
        NIXL / "pull_worker.py",
        "def _read_blocks_for_req(self, req_id: str, meta: ReqMeta)",
        "def _read_blocks_for_req(self, request_id: str, meta: ReqMeta)",
    )
    result = _check(tree)
    assert result.returncode == 1
    assert "_read_blocks_for_req(req_id, meta) does not override" in result.stdout
    assert "parameter 1 is 'req_id', not 'request_id'" in result.stdout


def test_a_private_attribute_kvloop_reads_is_named(vllm_tree, tmp_path):
    tree = _doctored(
        vllm_tree, tmp_path, NIXL / "base_worker.py", "self._invalid_remote_engines", "self._invalid_peers"
    )
    result = _check(tree)
    assert result.returncode == 1
    assert "KvloopConnectorWorker uses _invalid_remote_engines, which its vLLM bases lack" in result.stdout


def test_a_method_the_host_pool_calls_through_a_local_name_is_named(vllm_tree, tmp_path):
    # host_pool.py calls it as ``w._compute_desc_ids(...)`` after ``w = self.worker``
    tree = _doctored(
        vllm_tree, tmp_path, NIXL / "base_worker.py", "def _compute_desc_ids(", "def _compute_descriptor_ids("
    )
    result = _check(tree)
    assert result.returncode == 1
    assert "KvloopConnectorWorker uses _compute_desc_ids, which its vLLM bases lack" in result.stdout


def test_the_descriptor_form_of_the_installed_release_is_checked(vllm_tree, tmp_path):
    # compat.py builds the host pool's descriptors with 0.32.0's ``_stack_descs``
    tree = _doctored(vllm_tree, tmp_path, NIXL / "base_worker.py", "def _stack_descs(", "def _stack_rows(")
    result = _check(tree)
    assert result.returncode == 1
    assert "agents/connector/compat.py" in result.stdout
    assert "KvloopConnectorWorker uses _stack_descs, which its vLLM bases lack" in result.stdout


def test_a_handshake_field_the_host_pool_rewrites_is_named(vllm_tree, tmp_path):
    tree = _doctored(
        vllm_tree, tmp_path, NIXL / "metadata.py", "    block_strides: list[int]", "    strides: list[int]"
    )
    result = _check(tree)
    assert result.returncode == 1
    assert "kvloop uses NixlAgentMetadata.block_strides" in result.stdout
