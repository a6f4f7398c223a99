"""One checksum format for a run directory: config.yaml, plan.json and run.json are listed in the
run's ``manifest.json`` with their sizes and CRC32s, as a checkpoint's files are in its
``COMPLETE`` (``manifest.seal_run_files``). A flipped byte or a cut file is refused in one
line naming it; a write cut short by a kill leaves a file the manifest still vouches for; a run
recorded before the manifest (config.yaml's checksum comment line, no manifest) still resumes and
is written in the new form. Real files, real corruption."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from flopwise import manifest as run_files
from flopwise.checkpoints import CheckpointError, latest_checkpoint
from flopwise.cli import main
from flopwise.config import CHECKSUM_MARK, build_config
from flopwise.manifest import RUN_MANIFEST, read_run_json, run_file_problem, seal_run_files
from flopwise.train.trainer import train

QUIET = ["eval.every=0", "eval.sample_tokens=0", "train.log_every=1", "train.checkpoint_every=2"]
NAMES = ("config.yaml", "plan.json", "run.json")


def flip_byte(path: Path, at: int = 5) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def sealed(tmp_path: Path) -> Path:
    seal_run_files(tmp_path, {"config.yaml": "model: {d_model: 64}\n", "plan.json": json.dumps({"flops": 1.5e15}),
                              "run.json": json.dumps({"starts": [{"at_step": 0}]})})
    return tmp_path


def to_old_form(run: Path) -> None:
    """The run as flopwise wrote it before the manifest: no manifest.json, config.yaml ending in
    its SHA-256 comment line."""
    (run / RUN_MANIFEST).unlink()
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(f"{text}{CHECKSUM_MARK}{hashlib.sha256(text.encode()).hexdigest()}\n")


# --------------------------------------------------------------------------- the files and their manifest

def test_sealed_files_read_back_and_list_in_the_checkpoint_format(tmp_path):
    run = sealed(tmp_path)
    manifest = json.loads((run / RUN_MANIFEST).read_text())
    assert sorted(manifest["files"]) == sorted(NAMES)
    for name in NAMES:
        assert manifest["files"][name] == run_files.file_entry(run / name)  # COMPLETE's entries: bytes, crc32
        assert run_file_problem(run, name) == ""
    assert read_run_json(run, "plan.json") == {"flops": 1.5e15}
    assert run_file_problem(run, "preflight.json") is None  # not listed: nothing vouches either way


@pytest.mark.parametrize("name", ["plan.json", "run.json"])
def test_a_flipped_byte_is_refused_in_one_line_naming_the_file(tmp_path, name):
    run = sealed(tmp_path)
    flip_byte(run / name)
    with pytest.raises(CheckpointError) as err:
        read_run_json(run, name)
    text = str(err.value)
    assert text.startswith(f"{run / name}: changed since the run wrote it (checksum mismatch") and "\n" not in text


def test_a_torn_file_is_refused_naming_it(tmp_path):
    run = sealed(tmp_path)
    (run / "run.json").write_bytes((run / "run.json").read_bytes()[:7])  # what a non-atomic write cut leaves
    with pytest.raises(CheckpointError, match=r"run\.json: changed since the run wrote it \(7 bytes, the manifest "
                                              r"says \d+ \(truncated or replaced\)"):
        read_run_json(run, "run.json")
    (run / RUN_MANIFEST).write_text('{"files": ')  # a manifest that is not one vouches for nothing
    assert "unreadable manifest" in run_file_problem(run, "plan.json")


def test_a_write_killed_part_way_leaves_files_the_manifest_vouches_for(tmp_path, monkeypatch):
    run = sealed(tmp_path)
    old = (run / "run.json").read_bytes()
    real = run_files.write_file

    def killed(path, data, what="", kept=""):
        if Path(path).name == "run.json":
            raise KeyboardInterrupt  # the kill lands after the manifest announced the new run.json
        real(path, data, what, kept)

    monkeypatch.setattr(run_files, "write_file", killed)
    with pytest.raises(KeyboardInterrupt):
        seal_run_files(run, {"run.json": json.dumps({"starts": [{"at_step": 0}, {"at_step": 2}]})})
    assert "was" in json.loads((run / RUN_MANIFEST).read_text())["files"]["run.json"]
    assert (run / "run.json").read_bytes() == old and run_file_problem(run, "run.json") == ""
    monkeypatch.setattr(run_files, "write_file", real)
    seal_run_files(run, {"run.json": json.dumps({"starts": [{"at_step": 0}, {"at_step": 2}]})})
    assert "was" not in json.loads((run / RUN_MANIFEST).read_text())["files"]["run.json"]
    assert [run_file_problem(run, n) for n in NAMES] == ["", "", ""]
    (run / "run.json").write_bytes(old)  # the copy before, put back by hand: no longer the run's
    assert "checksum mismatch" in run_file_problem(run, "run.json") or "bytes" in run_file_problem(run, "run.json")


# --------------------------------------------------------------------------- a run: resume and refusal

def test_a_run_lists_its_files_and_a_flipped_byte_in_run_json_refuses_the_resume(tiny_overrides, capsys):
    overrides = [*tiny_overrides, *QUIET]
    first = train(build_config(overrides=overrides + ["train.max_steps=2"]), log=lambda s: None)
    assert [run_file_problem(first.run_dir, n) for n in NAMES] == ["", "", ""]
    assert CHECKSUM_MARK not in (first.run_dir / "config.yaml").read_text()  # one format: the manifest
    flip_byte(first.run_dir / "run.json", at=20)
    capsys.readouterr()
    assert main(["train", *overrides, "train.max_steps=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(first.run_dir / "run.json") in err[0], err
    assert "changed since the run wrote it (checksum mismatch" in err[0] and "--fresh" in err[0]
    assert latest_checkpoint(first.run_dir).name == "step-0000002"  # refused before anything was trained


@pytest.mark.parametrize("name", ["plan.json", "run.json"])
def test_report_and_eval_refuse_a_file_the_manifest_no_longer_vouches_for(tiny_overrides, capsys, name):
    """What a resume trusts, the report and eval trust alike: a flipped byte is one line naming the
    file (exit 2), not a report or an evaluation drawn from a file the run did not write. The
    change keeps the file valid JSON (a digit changed), as a hand edit would."""
    overrides = [*tiny_overrides, *QUIET]
    run = train(build_config(overrides=overrides + ["train.max_steps=2"]), log=lambda s: None).run_dir
    text = (run / name).read_text()
    at = next(i for i, c in enumerate(text) if c in "12345678")
    (run / name).write_text(text[:at] + str(int(text[at]) + 1) + text[at + 1:])
    commands = [["report", str(run), "--out", str(run.parent / "report")]]
    if name == "run.json":  # eval reads run.json (where the run started), not plan.json
        commands.append(["eval", str(run), "--windows", "2"])
    for command in commands:
        capsys.readouterr()
        assert main(command) == 2, command
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(run / name) in err[0] and "checksum mismatch" in err[0], (command, err)


def test_a_run_recorded_in_the_old_form_resumes_and_is_written_in_the_new(tiny_overrides):
    overrides = [*tiny_overrides, *QUIET]
    first = train(build_config(overrides=overrides + ["train.max_steps=2"]), log=lambda s: None)
    run = first.run_dir
    to_old_form(run)
    notes: list[str] = []
    resumed = train(build_config(overrides=overrides + ["train.max_steps=4"]), log=notes.append)
    assert resumed.steps == 4 and not any("config.yaml was" in n for n in notes), notes
    assert [run_file_problem(run, n) for n in NAMES] == ["", "", ""]
    assert CHECKSUM_MARK not in (run / "config.yaml").read_text()
    assert [s["at_step"] for s in read_run_json(run, "run.json")["starts"]] == [0, 2]  # the old run.json, read


def test_an_old_form_config_yaml_with_a_flipped_byte_is_not_trusted(tiny_overrides):
    overrides = [*tiny_overrides, *QUIET]
    first = train(build_config(overrides=overrides + ["train.max_steps=2"]), log=lambda s: None)
    run = first.run_dir
    to_old_form(run)
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace("log_every: 1", "log_every: 3", 1))  # checksum line kept
    notes: list[str] = []
    resumed = train(build_config(overrides=overrides + ["train.max_steps=4"]), log=notes.append)
    assert resumed.steps == 4
    assert any(f"{run / 'config.yaml'} was changed since the run wrote it (its checksum does not match): checked "
               f"against {run / 'checkpoints' / 'step-0000002' / 'config.yaml'} instead" in n for n in notes), notes
