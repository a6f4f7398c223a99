"""Optional packages are checked before any work, with the command that installs them (issue 19).

A missing package is simulated for real: each check runs in a fresh interpreter whose
``sys.meta_path`` starts with a finder that refuses the package (``import tensorboard``
raises ModuleNotFoundError there, as on a machine without it), never by patching the
function under test.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

from flopwise import deps

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = """
import sys
class _Missing:
    '''Makes the packages in BLOCKED (and their submodules) unimportable, as if not installed.'''
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Missing())
for _m in [m for m in sys.modules if m.split(".")[0] in BLOCKED]:
    del sys.modules[_m]
"""


def run_without(blocked, code, cwd, extra_path=None, timeout=300):
    """Run ``code`` in a fresh interpreter in which the packages ``blocked`` cannot be imported."""
    prelude = f"BLOCKED = {set(blocked)!r}\n" + BLOCKER
    env = dict(os.environ, HOME=str(cwd), PYTHONPATH=os.pathsep.join(
        [p for p in (extra_path, os.environ.get("PYTHONPATH")) if p]))
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_table_matches_the_extras_of_pyproject():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, o in deps.OPTIONAL.items():
        if o.install.startswith("pip install 'flopwise["):
            extra = o.install.split("[")[1].split("]")[0]
            assert any(req.startswith(o.package) for req in extras[extra]), (name, extra)
    assert deps.OPTIONAL["tensorboard"].install == "pip install 'flopwise[track]'"
    assert deps.OPTIONAL["wandb"].install == "pip install wandb"
    assert {deps.OPTIONAL[n].install for n in ("datasets", "pyarrow", "zstandard")} == {"pip install 'flopwise[data]'"}
    assert deps.OPTIONAL["matplotlib"].install == "pip install 'flopwise[report]'"
    assert deps.needs_for_file("a.parquet") == "pyarrow" and deps.needs_for_file("b.JSONL.zst") == "zstandard"
    assert deps.needs_for_file("c.txt.zstd") == "zstandard" and deps.needs_for_file("notes.zst") is None
    assert deps.needs_for_file("d.jsonl.gz") is None


def test_only_an_explicit_request_is_an_error(tmp_path):
    r = run_without({"tensorboard", "wandb", "datasets"}, """
        import json
        from flopwise.config import build_config
        from flopwise import deps
        out = {}
        for name, overrides in {"auto": [], "off": ["tracking.tensorboard=false"],
                                "tb": ["tracking.tensorboard=true"], "wandb": ["tracking.wandb=true"],
                                "tasks": ["eval.tasks=arc_easy,piqa"]}.items():
            out[name] = deps.missing_for_run(build_config(overrides=overrides))
        out["eval"] = deps.missing_for_eval(["arc_easy", "hellaswag"])
        out["eval_none"] = deps.missing_for_eval([])
        print(json.dumps(out))
    """, tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["auto"] == [] and out["off"] == [] and out["eval_none"] == []
    assert out["tb"] == ["tracking.tensorboard=true needs the tensorboard package: pip install 'flopwise[track]'"
                         " (or tracking.tensorboard=auto: TensorBoard only when installed)"]
    assert out["wandb"] == ["tracking.wandb=true needs the wandb package: pip install wandb"]
    assert out["tasks"][0].startswith("eval.tasks=arc_easy,piqa needs the datasets package: "
                                      "pip install 'flopwise[data]'")
    assert out["eval"][0].startswith("eval --tasks arc_easy,hellaswag needs the datasets package: "
                                     "pip install 'flopwise[data]'")


def test_an_installed_package_is_no_problem(tmp_path):
    stub = tmp_path / "site"
    for name in ("tensorboard", "wandb", "datasets"):
        (stub / name).mkdir(parents=True)
        (stub / name / "__init__.py").write_text("")
    r = run_without(set(), """
        from flopwise.config import build_config
        from flopwise import deps
        cfg = build_config(overrides=["tracking.tensorboard=true", "tracking.wandb=true", "eval.tasks=arc_easy"])
        assert deps.missing_for_run(cfg) == [], deps.missing_for_run(cfg)
        assert deps.missing_for_eval(["arc_easy"]) == []
        assert deps.missing_for_source("hf:roneneldan/TinyStories") == []
    """, tmp_path, extra_path=str(stub))
    assert r.returncode == 0, r.stderr


def test_the_tracker_refuses_before_it_opens_metrics_jsonl(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    r = run_without({"tensorboard"}, f"""
        from pathlib import Path
        from flopwise.config import TrackingConfig
        from flopwise.deps import MissingDependencyError
        from flopwise.measure.tracking import Tracker
        try:
            Tracker(Path({str(run_dir)!r}), TrackingConfig(tensorboard="true"), {{}}, "run")
        except MissingDependencyError as e:
            print("REFUSED", e)
        else:
            print("ACCEPTED")
    """, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "REFUSED" in r.stdout and "pip install 'flopwise[track]'" in r.stdout
    assert list(run_dir.iterdir()) == []  # no metrics.jsonl, no tensorboard/


@pytest.mark.slow
def test_train_refuses_a_missing_tensorboard_before_writing_anything(tmp_path):
    """Needs the lead's wiring: ``require(missing_for_run(cfg))`` first thing in ``train()``."""
    r = run_without({"tensorboard"}, """
        import sys
        from flopwise.cli import main
        sys.exit(main(["train", "tracking.tensorboard=true", "train.run_dir=run", "data.cache_dir=cache",
                       "train.max_steps=2", "data.builtin_max_mb=0.2", "train.device=cpu"]))
    """, tmp_path)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-3000:])
    assert "tracking.tensorboard=true needs the tensorboard package: pip install 'flopwise[track]'" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_eval_tasks_without_datasets_is_refused_before_any_model_or_data_is_read(tmp_path):
    """Needs the lead's wiring in ``cli.cmd_eval``: the check comes before the model is even
    looked for, so a path that does not exist still gets the missing-package message."""
    r = run_without({"datasets"}, """
        import sys
        from flopwise.cli import main
        sys.exit(main(["eval", "no-such-run", "--tasks", "arc_easy"]))
    """, tmp_path)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-3000:])
    assert "eval --tasks arc_easy needs the datasets package: pip install 'flopwise[data]'" in r.stderr
    assert "Traceback" not in r.stderr


def test_hugging_face_export_needs_only_the_core_dependencies():
    """`./install.sh` then `flopwise export --format hf` (issue: No module named 'safetensors')."""
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for name, o in deps.CORE.items():
        assert any(req.startswith(o.package) for req in core), name
    assert {"safetensors", "transformers"} <= set(deps.CORE)
    install = (ROOT / "install.sh").read_text()
    assert 'pip install -e ".${extras}"' in install  # the package with its core dependencies


def run_with_missing(missing, code, cwd):
    """Run ``code`` in a fresh interpreter where ``import NAME`` fails for real for each of
    ``missing``: ``sys.modules[NAME] = None`` makes the import system raise ImportError."""
    prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in missing)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=cwd,
                          env=dict(os.environ, HOME=str(cwd)), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_missing_package_is_one_line_naming_what_installs_it(tmp_path):
    r = run_with_missing(["torchao", "liger_kernel", "transformers"], """
        import json
        from flopwise import deps
        from flopwise.config import ModelConfig, build_config
        out = {"run": deps.missing_for_run(build_config(overrides=["train.fp8=true", "train.loss=fused"]))}
        from flopwise.model.hf import hf_config
        for name, call in (("load", lambda: deps.load("torchao.float8", "train.fp8=true")),
                           ("hf", lambda: hf_config(ModelConfig()))):
            try:
                call()
            except deps.MissingDependencyError as e:
                out[name] = str(e)
        print(json.dumps(out))
    """, tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["run"] == ["train.fp8=true needs the torchao package: pip install torchao",
                          "train.loss=fused needs the liger-kernel package: pip install liger-kernel"]
    assert out["load"] == "train.fp8=true needs the torchao package: pip install torchao"
    assert out["hf"] == ("a Hugging Face config (flopwise export --format hf) needs the transformers package: "
                         "pip install transformers")
    assert "\n" not in out["load"] and "\n" not in out["hf"]


@pytest.mark.slow
def test_the_command_line_prints_the_line_not_a_traceback(tmp_path):
    r = run_with_missing(["torchao"], """
        import sys
        from flopwise.cli import main
        sys.exit(main(["train", "train.fp8=true", "train.run_dir=run", "data.cache_dir=cache", "train.max_steps=2",
                       "train.device=cpu"]))
    """, tmp_path)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-3000:])
    assert "flopwise train: train.fp8=true needs the torchao package: pip install torchao" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()
