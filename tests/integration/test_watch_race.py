"""`flopwise eval --watch` against checkpoint retention: a checkpoint listed, then deleted by
training's retention before or while it is read, is skipped with a note; one that is still
there and fails its checks is an error. The deletions are real (``apply_retention``, the
function training calls), made at the racy moment through the watch's ``before_eval`` hook
or from inside the checksum pass of the load."""

import json

import pytest

from flopwise import manifest as manifest_module
from flopwise.checkpoints import CheckpointError, list_checkpoints
from flopwise.config import build_config
from flopwise.evaluate import runner
from flopwise.train.checkpoint import apply_retention
from flopwise.train.trainer import train


@pytest.fixture
def run_dir(tiny_overrides):
    """A finished tiny run with all three of its checkpoints kept: steps 2, 4 and 6."""
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=6", "train.checkpoint_every=2",
                                                   "train.keep_checkpoints=0", "eval.every=0",
                                                   "eval.sample_tokens=0"])
    result = train(cfg, log=lambda s: None)
    assert [p.name for p in list_checkpoints(result.run_dir)] == ["step-0000002", "step-0000004", "step-0000006"]
    return result.run_dir


def test_a_checkpoint_deleted_between_listing_and_loading_is_skipped(run_dir):
    """keep_checkpoints=1 pruning both older checkpoints right after watch listed them (on the
    old code: ModelSourceError 'no such directory' out of watch)."""
    pruned = []

    def prune(ckpt):
        if not pruned:
            pruned.extend(apply_retention(run_dir, keep_last=1))
            assert not ckpt.exists()

    lines = []
    assert runner.watch(run_dir, poll_s=0.01, log=lines.append, before_eval=prune) == 1
    assert [p.name for p in pruned] == ["step-0000002", "step-0000004"]
    assert runner.evaluated_steps(run_dir) == {6}
    skipped = [line for line in lines if "was deleted while it was read" in line]
    assert [line.split()[1] for line in skipped] == ["step-0000002", "step-0000004"]


def test_a_checkpoint_deleted_while_its_files_are_verified_is_skipped(run_dir, monkeypatch):
    """Retention renames step-2 away after the first of its files passed its checksum: the next
    file is 'missing from the checkpoint' (a CheckpointError), and the checkpoint is gone."""
    real_crc = manifest_module._file_crc
    pruned = []

    def crc_then_prune(path):
        crc = real_crc(path)
        if not pruned and path.parent.name == "step-0000002":
            pruned.extend(apply_retention(run_dir, keep_last=2))  # step-2 only
        return crc

    monkeypatch.setattr(manifest_module, "_file_crc", crc_then_prune)
    errors = []
    real_evaluate = runner.evaluate

    def evaluate(*a, **kw):
        try:
            return real_evaluate(*a, **kw)
        except Exception as e:
            errors.append(e)
            raise

    monkeypatch.setattr(runner, "evaluate", evaluate)
    lines = []
    assert runner.watch(run_dir, poll_s=0.01, log=lines.append) == 2
    assert [p.name for p in pruned] == ["step-0000002"]
    assert len(errors) == 1 and isinstance(errors[0], (CheckpointError, FileNotFoundError))
    assert runner.evaluated_steps(run_dir) == {4, 6}
    assert any("step-0000002 was deleted while it was read" in line for line in lines)


def test_a_checkpoint_that_is_still_there_and_fails_verification_is_an_error(run_dir):
    manifest = json.loads((run_dir / "checkpoints" / "step-0000004" / "COMPLETE").read_text())
    name = next(n for n in manifest["files"] if n.endswith(".pt"))
    f = run_dir / "checkpoints" / "step-0000004" / name
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        runner.watch(run_dir, poll_s=0.01, log=lambda s: None)
    assert runner.evaluated_steps(run_dir) == {2}  # evaluated before it, nothing after
