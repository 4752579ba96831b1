"""The differences between the vLLM releases kvloop supports (``kvloop.common.vllm_compat``), one small
adapter each, chosen by the installed version. ``make vllm-compat`` checks the symbols each one uses
against each release's source (its ``VERSION_SPECIFIC`` table names the ones a single release has).

* Registration generation (0.33.0): vLLM's NIXL scheduler counts how often its engine published a
  changed KV-cache registration (``_registration_generation``, bumped when a woken engine registers
  its memory again) and puts it in the reverse-pull params (``remote_registration_generation``); a
  puller re-handshakes a peer whose generation rose. kvloop announces each run with the generation it
  was retained under, forwards it in the params it builds, and never reads a run announced under an
  older generation than the one last seen for its holder. 0.32.0 has no generation: always 0.
* Sleep mode (0.33.0 adds it to the NIXL connector): supported where NixlConnector supports it. As
  the engine pauses to sleep, vLLM resets the connector's cache: the runs retained in the KV cache
  leave the directory before their memory goes (``DecodeSide.cache_reset``); the host pool, host
  memory, stays registered and served (``kvloop_host_on_reset`` "drop" releases it too, for
  deployments that change weights while asleep); copies into it end before the KV cache is
  deregistered (``KvloopConnectorWorker.unregister_kv_caches``). At wake the engine registers its KV
  cache again under a new generation, which fences whatever was retained before.
* Transfer descriptors: 0.32.0 describes a KV-cache region with one (address, length, device) row
  per block (``_stack_descs``); 0.33.0 with strided rows (``_pack_strided_descs``: address, length,
  device, stride, count), one per region, which NIXL >= 1.5 expands block by block. A descriptor id
  is a flat block index in both (``_compute_desc_ids`` is the same), so only the lists differ. The
  host retention pool describes its regions with the installed release's own code
  (:func:`region_descs`) and prepares them as that release does (:func:`prep_region_dlist`); the
  pool's handshake (``block_strides`` equal to ``block_lens``, ``region_num_blocks`` its slots) is
  read by either release's pull code unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import vllm

from kvloop.common.vllm_compat import at_least, release_of

if TYPE_CHECKING:
    from kvloop.agents.connector.worker import KvloopConnectorWorker

VLLM_RELEASE = release_of(vllm.__version__)

# vLLM 0.33.0: kv_transfer_params and RemoteMeta carry the holder's registration generation.
HAS_REGISTRATION_GENERATION = at_least(VLLM_RELEASE, "0.33.0")
# vLLM 0.33.0: transfer descriptors are strided, one row per region instead of one per block.
STRIDED_DESCRIPTORS = at_least(VLLM_RELEASE, "0.33.0")
GENERATION_PARAM = "remote_registration_generation"


def registration_generation(scheduler: Any) -> int:
    """The registration generation this engine's NIXL scheduler publishes (0 before vLLM 0.33)."""
    if not HAS_REGISTRATION_GENERATION:
        return 0
    return int(getattr(scheduler, "_registration_generation", 0))


def forward_generation(params: dict[str, Any], generation: int) -> None:
    """Put the holder's generation into reverse-pull params vLLM reads (0.33: RemoteMeta)."""
    if HAS_REGISTRATION_GENERATION:
        params[GENERATION_PARAM] = generation


def remote_generation(remote: Any) -> int:
    """The registration generation a pull's ``RemoteMeta`` carries (0 before vLLM 0.33)."""
    if not HAS_REGISTRATION_GENERATION:
        return 0
    return int(getattr(remote, "registration_generation", 0) or 0)


# A region of blocks laid back to back: (base address, bytes per block, blocks).
DenseRegion = tuple[int, int, int]


def region_descs(worker: KvloopConnectorWorker, regions: Sequence[DenseRegion], device_id: int) -> np.ndarray:
    """NIXL descriptors of ``regions``, region after region, in the installed vLLM's form and built by
    its own code, so that they line up with the descriptor ids ``_compute_desc_ids`` gives."""
    if STRIDED_DESCRIPTORS:
        return strided_region_descs(worker, regions, device_id)
    return stacked_region_descs(worker, regions, device_id)


def stacked_region_descs(
    worker: KvloopConnectorWorker, regions: Sequence[DenseRegion], device_id: int
) -> np.ndarray:
    """vLLM 0.32.0's form: an Nx3 array, one (address, length, device) row per block."""
    worker_032: Any = worker  # typed by the installed vLLM, which may be another release
    return np.concatenate(
        [
            worker_032._stack_descs(
                np.uint64(base) + np.arange(blocks, dtype=np.uint64) * np.uint64(block_len),
                block_len,
                device_id,
            )
            for base, block_len, blocks in regions
        ]
    )


def strided_region_descs(
    worker: KvloopConnectorWorker, regions: Sequence[DenseRegion], device_id: int
) -> np.ndarray:
    """vLLM 0.33.0's form: an Nx5 array, one (address, length, device, stride, count) row per region
    (dense: the stride is the block length)."""
    worker_033: Any = worker  # typed by the installed vLLM, which may be another release
    return worker_033._pack_strided_descs(
        [(base, block_len, device_id, block_len, blocks) for base, block_len, blocks in regions]
    )


def prep_region_dlist(wrapper: Any, agent_name: str, descs: np.ndarray, mem_type: str) -> Any:
    """Prepare descriptors from :func:`region_descs` for transfers by descriptor id, as their release
    does: 0.32.0 wraps its Nx3 rows in a NIXL descriptor list first; NIXL (>= 1.5) takes 0.33.0's
    strided rows with their memory type beside them."""
    if descs.shape[1] == 5:
        return wrapper.prep_xfer_dlist(agent_name, descs, mem_type=mem_type)
    return wrapper.prep_xfer_dlist(agent_name, wrapper.get_xfer_descs(descs, mem_type))
