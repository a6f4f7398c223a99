"""The commands that need no model start without torch (about 2 s of CPU to import): ``--help``,
``plan``, ``presets``, ``train --print-config``, a config error, and ``report``'s module, which
checks a run's files against its manifest (``flopwise/manifest.py``, free of torch). The CLI
imports what needs torch inside the subcommand that needs it (``# lazy:``)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import contextlib, io, sys
from flopwise.cli import main
import flopwise.report
for argv in (["plan", "--model", "smollm-360m", "--gpu", "a100"], ["presets"], ["train", "--print-config"],
             ["train", "model.n_layer=2"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(argv)
    assert "torch" not in sys.modules, f"flopwise {' '.join(argv)} imported torch"
print("ok")
"""


def test_plan_presets_print_config_and_report_import_no_torch():
    done = subprocess.run([sys.executable, "-P", "-c", CODE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr[-2000:]


def test_the_check_sees_torch_when_it_is_imported():
    """The same check, with torch imported by hand: it fails, so it can fail."""
    code = CODE.replace("import flopwise.report", "import flopwise.report, torch")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "imported torch" in done.stderr, done.stdout + done.stderr[-2000:]
