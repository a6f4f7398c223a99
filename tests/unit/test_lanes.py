"""The test lanes tests/conftest.py sets up: the on-request lane (``extended``) runs only when
``-m`` names it, and the heavy files are handed out first (``HEAVY_FIRST``), in a pytest of
their own (pytester) that reads this project's conftest."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parents[1]
FILES = {
    "test_cheap.py": "import pytest\n\ndef test_cheap():\n    pass\n\n"
                     "@pytest.mark.extended\ndef test_again_at_more_cost():\n    pass\n",
    "integration/test_doc_commands.py": "def test_docs():\n    pass\n",
    "integration/test_dryrun.py": "def test_matrix():\n    pass\n",
}


def _project(pytester, monkeypatch) -> None:
    """The stand-in project. Its heavy files carry the real ones' module names (HEAVY_FIRST is by
    name), so a worker that ran the real ones first has them in sys.modules: the in-process run
    would refuse them as another file's ("import file mismatch"). They are set aside meanwhile."""
    for name in FILES:
        monkeypatch.delitem(sys.modules, Path(name).stem, raising=False)
    for name in ("conftest.py", "helpers.py"):
        shutil.copy(TESTS / name, pytester.path / name)
    pytester.makeini("[pytest]\nmarkers =\n    extended: on request\n")
    for name, text in FILES.items():
        (pytester.path / name).parent.mkdir(exist_ok=True)
        (pytester.path / name).write_text(text)


def test_the_extended_lane_runs_only_when_asked(pytester, monkeypatch):
    _project(pytester, monkeypatch)
    default = pytester.runpytest_inprocess("-q")
    default.assert_outcomes(passed=3, deselected=1)
    asked = pytester.runpytest_inprocess("-q", "-m", "extended")
    asked.assert_outcomes(passed=1, deselected=3)
    fast = pytester.runpytest_inprocess("-q", "-m", "not slow")
    fast.assert_outcomes(passed=3, deselected=1)


def test_the_heavy_files_come_first(pytester, monkeypatch):
    _project(pytester, monkeypatch)
    done = pytester.runpytest_inprocess("--collect-only", "-q")
    files = [line.split("::")[0] for line in done.outlines if "::" in line]
    assert files == ["integration/test_dryrun.py", "integration/test_doc_commands.py", "test_cheap.py"], files
