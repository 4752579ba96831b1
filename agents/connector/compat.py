"""The differences between the vLLM releases kvloop supports (``kvloop.common.vllm_compat``), one small
adapter each, chosen by the installed version. ``make vllm-compat`` checks the symbols each one uses
against each release's source (its ``VERSION_SPECIFIC`` table names the ones a single release has).

* Registration generation (0.33.0): vLLM's NIXL scheduler counts how often its engine published a
  changed KV-cache registration (``_registration_generation``, bumped when a woken engine registers
  its memory again) and puts it in the reverse-pull params (``remote_registration_generation``); a
  puller re-handshakes a peer whose generation rose. kvloop announces each run with the generation it
  was retained under, forwards it in the params it builds, and never reads a run announced under an
  older generation than the one last seen for its holder. 0.32.0 has no generation: always 0.
* Sleep mode (0.33.0 adds it to the NIXL connector): refused. Sleeping discards the KV cache, so every
  run a decode retains would point at freed memory; kvloop does not support it yet (see README).
* Transfer descriptors: 0.32.0 builds them with ``_stack_descs``; 0.33.0 replaced it with strided
  descriptors (``_pack_strided_descs``). The host retention pool builds its descriptors like 0.32.0
  and is refused (one line) on 0.33.0.
"""

from __future__ import annotations

from typing import Any

import vllm

from kvloop.common.vllm_compat import at_least, release_of

VLLM_RELEASE = release_of(vllm.__version__)

# vLLM 0.33.0: kv_transfer_params and RemoteMeta carry the holder's registration generation.
HAS_REGISTRATION_GENERATION = at_least(VLLM_RELEASE, "0.33.0")
# The host pool's descriptors follow 0.32.0's layout (``_stack_descs``).
HOST_POOL_SUPPORTED = not at_least(VLLM_RELEASE, "0.33.0")
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


def host_pool_refusal() -> str | None:
    if HOST_POOL_SUPPORTED:
        return None
    return (
        f"kvloop_host_retention_gib needs vLLM 0.32.0's transfer descriptors; vLLM {VLLM_RELEASE} "
        "builds strided ones: set it to 0"
    )


SLEEP_MODE_REFUSAL = (
    "kvloop's connector does not support sleep mode: sleeping discards the KV cache its retained "
    "runs point at; run without --enable-sleep-mode"
)
