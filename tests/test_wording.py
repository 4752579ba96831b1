"""scripts/check_wording.py: references to how the project was developed fail the check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_wording.py"


def run_checker(*files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, files)], capture_output=True, text=True, timeout=60
    )


def test_a_development_round_fails(tmp_path: Path) -> None:
    notes = tmp_path / "notes.md"
    notes.write_text("# Figures\n\nThe Lookup takes 50 us, as measured in session 12.\n")
    result = run_checker(notes)
    assert result.returncode == 1
    assert f"{notes}:3: session 12" in result.stdout


@pytest.mark.parametrize(
    "line",
    [
        "a figure from the last stop",
        "fixed in issue 17",
        "see #42",
        "paired against the previous code (2ca471d, run from a worktree)",
        "as of commit 4559bcb",
        "Round 3 of the work",
    ],
)
def test_other_round_references_fail(tmp_path: Path, line: str) -> None:
    text = tmp_path / "text.py"
    text.write_text(f"# {line}\n")
    assert run_checker(text).returncode == 1


def test_clean_text_passes(tmp_path: Path) -> None:
    clean = tmp_path / "clean.md"
    clean.write_text(
        "Measured 2026-12-06 on a 2-core x86_64 VM with `kvloop bench directory`: 1 session 1.79 ms,\n"
        "4 sessions, 12 rounds each; vLLM #42892 and vllm-project/vllm#123 are upstream.\n"
        "A colour #1f77b4, a hash deadbeef01, sha256 (0123456789) and a SIGSTOP for 2 s.\n"
    )
    result = run_checker(clean)
    assert result.returncode == 0, result.stdout
    assert result.stdout == ""
