"""`make test-fast` runs the top-level modules of tests/ on a venv without vLLM, so none of them may
import what only the engine side installs: there such a module fails to load, or, behind
``pytest.importorskip``, leaves the fast suite quietly short of its tests. Tests that need vLLM's
code go in tests/engines, those that need the served stack in tests/e2e. (A kvloop module that
imports vLLM itself shows only when the fast suite runs without it, as CI runs it.)"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent
# what `make setup-engines` installs (vLLM brings torch, transformers, tokenizers and jinja2)
ENGINE_SIDE = ("vllm", "nixl", "torch", "transformers", "tokenizers", "jinja2", "safetensors")


def _engine_side(name: str) -> bool:
    return name.split(".")[0] in ENGINE_SIDE


def _uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if _engine_side(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [f"from {node.module} import ..."] if _engine_side(node.module) else []
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "importorskip"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and _engine_side(node.args[0].value)
        ):
            found.append(f"importorskip({node.args[0].value!r})")
    return [f"{path.name}:{use}" for use in found]


def test_no_top_level_test_module_needs_the_engine_side():
    offenders = [use for path in sorted(TESTS.glob("*.py")) for use in _uses(path)]
    assert offenders == [], f"move these tests to tests/engines: {offenders}"


def test_the_check_sees_every_form_of_import(tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "import json\nimport vllm.config\nfrom torch import nn\nfrom kvloop.common import tokens\n"
        "import pytest\nkv = pytest.importorskip('vllm.distributed.kv_events')\n"
        "def test_x():\n    import jinja2\n    from . import support\n"
    )
    assert _uses(sample) == [
        "test_sample.py:import vllm.config",
        "test_sample.py:from torch import ...",
        "test_sample.py:importorskip('vllm.distributed.kv_events')",
        "test_sample.py:import jinja2",
    ]
