"""``ruff check src`` and ``mypy`` (its files and settings: ``[tool.mypy]`` in pyproject.toml)
pass, so CI (``python -m pytest``) keeps ``src/`` lint- and type-clean.

Both run from the repository root, as a developer runs them, through this interpreter
(``python -m ruff``, ``python -m mypy``: the test extra installs them). mypy keeps its cache
in ``.mypy_cache`` (git-ignored): about 40 s cold on 2 cores, about 1 s warm; marked
``slow``, it stays out of the fast lane."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed: pip install -e '.[test]'")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


def test_ruff_passes_on_src():
    r = _run("ruff", "check", "src")
    assert r.returncode == 0, f"ruff check src:\n{r.stdout}{r.stderr}"


@pytest.mark.slow
def test_mypy_passes():
    r = _run("mypy")
    assert r.returncode == 0, f"mypy:\n{r.stdout}{r.stderr}"
