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
        "figures of earlier rounds",
    ],
)
def test_other_round_references_fail(tmp_path: Path, line: str) -> None:
    text = tmp_path / "text.py"
    text.write_text(f"# {line}\n")
    assert run_checker(text).returncode == 1


def test_the_tests_are_checked_too(tmp_path: Path) -> None:
    """Run without files, the check covers tests/ (a test docstring naming an issue fails); only its
    own tests, which spell what it must catch, are left out."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "test_x.py").write_text('"""The reader (issue 12 item 3)."""\n')
    (repo / "tests" / "test_wording.py").write_text('"""fixed in issue 17"""\n')
    subprocess.run(["git", "init", "-q", str(repo)], check=True, timeout=60)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True, timeout=60)
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], cwd=repo, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "tests/test_x.py:1: issue 12" in result.stdout and "test_wording" not in result.stdout


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
