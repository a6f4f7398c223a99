"""Crash-safe checkpoints: atomic publication, manifest checksums, retention, disk-full saves, kill -9."""

import json
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from flopwise.checkpoints import (
    CheckpointError,
    adopt_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    unmarked_checkpoints,
    verify_checkpoint,
)
from flopwise.fsio import describe_write_error
from flopwise.manifest import file_entry
from flopwise.train.checkpoint import apply_retention, rng_state, save_checkpoint, set_rng_state


def model_and_opt(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def test_round_trip_with_rng_and_manifest(tmp_path):
    model, opt = model_and_opt()
    torch.manual_seed(123)
    path = save_checkpoint(tmp_path, 7, model, opt, {"tokens": 99}, "model: {}\n", rng=rng_state())
    expected_next = torch.rand(3)
    manifest = verify_checkpoint(path)
    assert set(manifest["files"]) == {"model.pt", "optimizer.pt", "rng.pt", "state.json", "config.yaml"}
    model2, opt2 = model_and_opt(seed=1)
    state = load_checkpoint(path, model2, opt2)
    assert state["step"] == 7 and state["tokens"] == 99
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    set_rng_state(state["rng"])
    assert torch.equal(torch.rand(3), expected_next)


def test_partial_checkpoints_are_never_picked_and_leftovers_are_swept(tmp_path):
    model, opt = model_and_opt()
    good = save_checkpoint(tmp_path, 2, model, opt, {}, "")
    root = tmp_path / "checkpoints"
    (root / ".tmp-step-0000003").mkdir()  # a save killed before its rename
    (root / ".tmp-step-0000003" / "model.pt").write_bytes(b"half")
    no_marker = root / "step-0000004"  # a directory that lost its marker
    no_marker.mkdir()
    (no_marker / "model.pt").write_bytes(b"x")
    assert latest_checkpoint(tmp_path) == good and list_checkpoints(tmp_path) == [good]
    save_checkpoint(tmp_path, 5, model, opt, {}, "")
    assert not (root / ".tmp-step-0000003").exists()
    assert latest_checkpoint(tmp_path).name == "step-0000005"


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_damaged_files_are_named(tmp_path, damage):
    model, opt = model_and_opt()
    path = save_checkpoint(tmp_path, 1, model, opt, {}, "")
    target = path / "optimizer.pt"
    raw = bytearray(target.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x40
        target.write_bytes(bytes(raw))
        match = "optimizer.pt: checksum mismatch"
    elif damage == "truncate":
        target.write_bytes(bytes(raw[:-10]))
        match = "optimizer.pt: .* bytes, the manifest says"
    else:
        target.unlink()
        match = "optimizer.pt: missing"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path, *model_and_opt(seed=2))


@pytest.mark.parametrize("leave_kb", [0, 12, 32])  # full inside model.pt, rng.pt, or the small files
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(small_fs, leave_kb, fill_fs):
    """On a real tmpfs: the disk fills during the save (torch.save's own error, not an imitation)."""
    model, opt = model_and_opt()
    fs = small_fs("512k")
    previous = save_checkpoint(fs, 10, model, opt, {"tokens": 1}, "model: {}\n", rng=rng_state())
    fill_fs(fs, leave_kb * 1024)
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(fs, 20, model, opt, {"tokens": 2}, "model: {}\n", rng=rng_state())
    assert "could not save checkpoint step 20" in str(err.value)
    assert "no space left on the device" in str(err.value)
    assert f"{previous} is intact" in str(err.value)
    assert latest_checkpoint(fs) == previous
    assert not list((fs / "checkpoints").glob(".tmp-*")), "the partial save was left on the full disk"
    assert load_checkpoint(previous, *model_and_opt(seed=3))["tokens"] == 1


def test_a_full_disk_error_from_torch_save_is_recognised(small_fs, fill_fs):
    """torch.save into a path on a full disk raises RuntimeError (no errno): still a full disk."""
    fs = small_fs("128k")
    fill_fs(fs, 4096)
    with pytest.raises(RuntimeError) as err:
        torch.save({"w": torch.zeros(100_000)}, fs / "x.pt")
    assert describe_write_error(err.value) == "no space left on the device", str(err.value)


def test_retention_keeps_the_newest_and_milestones(tmp_path):
    model, opt = model_and_opt()
    for step in range(1, 11):
        save_checkpoint(tmp_path, step, model, None, {}, "")
        apply_retention(tmp_path, keep_last=2, milestone_every=4)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000004", "step-0000008", "step-0000009",
                                                            "step-0000010"]
    # A deletion killed midway: renamed first, so it never looks like a checkpoint.
    half = tmp_path / "checkpoints" / ".deleting-step-0000003"
    half.mkdir()
    (half / "COMPLETE").write_text("{}")
    assert latest_checkpoint(tmp_path).name == "step-0000010"
    apply_retention(tmp_path, keep_last=2, milestone_every=4)
    assert not half.exists()
    assert apply_retention(tmp_path, keep_last=0) == []  # 0 keeps everything


@pytest.mark.slow
def test_kill_9_at_random_moments_of_saving_never_leaves_a_partial_checkpoint(tmp_path):
    """A child saves checkpoints of a ~2 MB model in a loop; it is SIGKILLed at random moments,
    many times. After every kill the newest complete checkpoint verifies and loads."""
    script = textwrap.dedent("""
        import sys, torch
        from flopwise.train.checkpoint import latest_checkpoint, save_checkpoint, apply_retention
        torch.manual_seed(0)
        model = torch.nn.Linear(512, 1024)
        last = latest_checkpoint(sys.argv[1])
        step = int(last.name[5:]) if last else 0
        print("ready", flush=True)
        while True:
            step += 1
            with torch.no_grad():
                model.weight.fill_(step)
            save_checkpoint(sys.argv[1], step, model, None, {"tokens": step}, "")
            apply_retention(sys.argv[1], keep_last=2)
    """)
    rng = random.Random(0)
    kills = 0
    for i in range(12):
        proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"  # imports done (however slow the machine), saving starts now
        deadline = time.time() + 60
        while i == 0 and latest_checkpoint(tmp_path) is None and time.time() < deadline:
            time.sleep(0.01)  # the first child saves once before its kill: a checkpoint to find afterwards
        time.sleep(rng.random() * 0.5)  # then anywhere in the save loop
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        kills += 1
        last = latest_checkpoint(tmp_path)
        if last is None:
            continue
        verify_checkpoint(last)
        model = torch.nn.Linear(512, 1024)
        state = load_checkpoint(last, model)
        assert model.weight[0, 0].item() == state["step"] == state["tokens"]
    assert kills == 12 and latest_checkpoint(tmp_path) is not None
    assert len(list_checkpoints(tmp_path)) <= 3
    json.loads((latest_checkpoint(tmp_path) / "COMPLETE").read_text())


def test_a_checkpoint_without_its_marker_is_refused_until_adopted(tmp_path):
    """Deleting COMPLETE must not switch verification off: unmarked directories are not
    checkpoints until the user vouches for them with adopt (which checks them first)."""
    model, opt = model_and_opt()
    path = save_checkpoint(tmp_path, 3, model, opt, {"tokens": 5}, "model: {}\n", rng=rng_state())
    (path / "COMPLETE").unlink()  # what flopwise 0.1 wrote -- or what an attacker leaves
    assert latest_checkpoint(tmp_path) is None and unmarked_checkpoints(tmp_path) == [path]
    with pytest.raises(CheckpointError, match="no COMPLETE marker.*flopwise checkpoint adopt"):
        load_checkpoint(path, *model_and_opt(seed=4))
    manifest = adopt_checkpoint(path)
    assert manifest["adopted"] and set(manifest["files"]) >= {"model.pt", "optimizer.pt", "rng.pt", "state.json"}
    assert latest_checkpoint(tmp_path) == path
    assert load_checkpoint(path, *model_and_opt(seed=4))["tokens"] == 5


def test_adopt_refuses_nan_weights_and_bad_state(tmp_path):
    model, opt = model_and_opt()
    path = save_checkpoint(tmp_path, 3, model, opt, {"tokens": 5}, "")
    (path / "COMPLETE").unlink()
    sd = model.state_dict()
    sd["0.weight"] = torch.full_like(sd["0.weight"], float("nan"))
    torch.save(sd, path / "model.pt")
    with pytest.raises(CheckpointError, match="non-finite weights in 0.weight"):
        adopt_checkpoint(path)
    assert not (path / "COMPLETE").exists()


@pytest.mark.parametrize("content, match", [
    ('{"step": 3, "tokens": -1}', "'tokens' = -1: must be >= 0"),
    ('{"step": 4, "tokens": 1}', "'step' = 4 but the directory is step-0000003"),
    ('{"step": 3, "tokens": "many"}', "'tokens' = 'many': expected int"),
    ('{"step": 3}', "'tokens' is missing"),
    ('{"step": 3, "tokens": 1, "loader": 7}', "'loader' = 7: expected dict"),
    ('{"step": 3, "tokens"', "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
])
def test_a_malformed_state_json_is_named(tmp_path, content, match):
    """Even with a manifest that matches (rewritten by whoever edited the file)."""
    model, opt = model_and_opt()
    path = save_checkpoint(tmp_path, 3, model, opt, {"tokens": 5}, "")
    (path / "state.json").write_text(content)
    (path / "COMPLETE").unlink()
    adopt = pytest.raises(CheckpointError, match=f"state.json: .*{match}")
    with adopt:
        adopt_checkpoint(path)  # adopt checks state.json before it writes a manifest
    rewrite_manifest(path)
    with pytest.raises(CheckpointError, match=f"state.json: .*{match}"):
        load_checkpoint(path, *model_and_opt(seed=4))


def rewrite_manifest(path):
    """What an attacker (or a careless edit tool) does: a manifest that matches the files as they are."""
    files = {str(p.relative_to(path)): file_entry(p) for p in sorted(path.rglob("*"))
             if p.is_file() and p.name != "COMPLETE"}
    (path / "COMPLETE").write_text(json.dumps({"format": 1, "step": 0, "files": files}))
