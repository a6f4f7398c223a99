"""Trust in a run directory, caused for real: planted payloads in every file a loader reads, a
second writer, a SIGKILLed holder, a full filesystem, a missing marker, a cut config.yaml.

CPU, the tiny model on the small corpus. A payload, if any loader ever unpickled it, would
create a marker file; every test asserts that file never appears.
"""

import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import flopwise
from flopwise.checkpoints import CheckpointError, latest_checkpoint, list_checkpoints
from flopwise.config import ConfigError, build_config
from flopwise.evaluate.runner import EvalOptions, evaluate
from flopwise.fsio import DirLock, LockedError, WriteError, write_file
from flopwise.manifest import file_entry
from flopwise.model.io import ModelSourceError, export_consolidated, export_hf
from flopwise.train.trainer import train

QUIET = ["eval.every=0", "eval.sample_tokens=0", "train.log_every=1"]


class Payload:
    """What a malicious file carries: unpickling it runs a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def reseal(ckpt: Path) -> None:
    """An attacker who rewrites a file also rewrites the manifest's size and CRC32 for it."""
    manifest = json.loads((ckpt / "COMPLETE").read_text())
    manifest["files"] = {name: file_entry(ckpt / name) for name in manifest["files"]}
    (ckpt / "COMPLETE").write_text(json.dumps(manifest))


def torch_payload(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"weight": Payload(marker)}, buf)  # a genuine torch zip file whose data.pkl runs code
    return buf.getvalue()


def plant_in_distcp(ckpt: Path, marker: Path) -> None:
    """Point one non-tensor value of a sharded checkpoint (an optimizer hyper-parameter, stored by
    DCP as a torch.save blob that its default planner reads with the full unpickler) at a payload."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta_path = ckpt / "sharded" / ".metadata"
    meta = pickle.loads(meta_path.read_bytes())  # the test's own, genuine file
    fqn = next(k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    index, info = next((i, s) for i, s in meta.storage_data.items() if i.fqn == fqn)
    data_file = ckpt / "sharded" / info.relative_path
    blob = torch_payload(marker)
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(blob)
    info.offset, info.length = offset, len(blob)
    meta_path.write_bytes(pickle.dumps(meta))


def loaders(run: Path, cfg_overrides: list[str], tmp: Path):
    """Every way flopwise reads a run: (name, call)."""
    return [
        ("flopwise.load", lambda: flopwise.load(run)),
        ("eval", lambda: evaluate(run, EvalOptions(windows=2, seq_len=32, device="cpu"), log=lambda s: None)),
        ("export hf", lambda: export_hf(run, tmp / "hf", overwrite=True, log=lambda s: None)),
        ("export pt", lambda: export_consolidated(run, tmp / "pt", overwrite=True, log=lambda s: None)),
        ("resume", lambda: train(build_config(overrides=cfg_overrides + ["train.max_steps=3"]), log=lambda s: None)),
    ]


@pytest.fixture(scope="module")
def runs(small_builtin, tmp_path_factory):
    """A finished 2-step run of each checkpoint format: model.pt (single) and sharded/ (fsdp2, one rank)."""
    cache, _ = small_builtin
    root = tmp_path_factory.mktemp("trust-runs")
    base = [f"data.cache_dir={cache}", "data.builtin_vocab_size=512", "data.builtin_max_mb=0.6",
            "model.vocab_size=512", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
            "model.ffn_hidden=64", "model.max_seq_len=32", "train.seq_len=32", "train.micro_batch_size=4",
            "train.global_batch_size=4", "optim.warmup_steps=1", *QUIET, "train.max_steps=2"]
    out = {}
    for fmt, extra in (("single", []), ("sharded", ["parallel.strategy=fsdp2"])):
        overrides = base + extra + [f"train.run_dir={root / fmt}"]
        train(build_config(overrides=overrides), log=lambda s: None)
        out[fmt] = (root / fmt, overrides)
    return out


PLANTS = [  # (format, file in the checkpoint, how the payload is planted)
    ("single", "model.pt", "torch"), ("single", "optimizer.pt", "torch"), ("single", "rng.pt", "torch"),
    ("single", "config.yaml", "yaml"), ("sharded", "rng.pt", "torch"), ("sharded", "sharded/.metadata", "pickle"),
    ("sharded", "sharded/__0_0.distcp", "distcp"), ("sharded", "config.yaml", "yaml"),
]


@pytest.mark.parametrize("fmt, name, how", PLANTS, ids=[f"{f}-{n}" for f, n, _ in PLANTS])
def test_no_file_of_a_checkpoint_can_run_code(runs, tmp_path, fmt, name, how):
    src, overrides = runs[fmt]
    run = tmp_path / "run"
    shutil.copytree(src, run)
    overrides = [o for o in overrides if not o.startswith("train.run_dir=")] + [f"train.run_dir={run}"]
    ckpt = latest_checkpoint(run)
    marker = tmp_path / "PWNED"
    target = ckpt / name
    if how == "torch":
        target.write_bytes(torch_payload(marker))
    elif how == "pickle":
        target.write_bytes(pickle.dumps(Payload(marker)))
    elif how == "distcp":
        plant_in_distcp(ckpt, marker)
    else:  # YAML's own route to code: python/object tags (yaml.load would run it; safe_load refuses)
        target.write_text(f"!!python/object/apply:os.system [\"touch {marker}\"]\n")
        (run / "config.yaml").write_text(target.read_text())
    reseal(ckpt)
    named = name.split("/")[-1] if how != "distcp" else "sharded checkpoint"
    refusals = []
    for what, load in loaders(run, overrides, tmp_path):
        try:
            load()  # a loader that does not read this file (load and eval skip optimizer.pt) succeeds
        except (CheckpointError, ConfigError, ModelSourceError) as refused:
            assert named in str(refused), f"{what}: the error does not name the file: {refused}"
            refusals.append(what)
        assert not marker.exists(), f"{what}: the payload in {name} ran"
    assert "resume" in refusals, f"resuming read {name} without refusing it (refused by: {refusals})"


def test_a_payload_would_run_under_a_full_unpickler(tmp_path):
    """The payloads above are live: the same bytes run their command under torch.load(weights_only=False)."""
    marker = tmp_path / "PWNED"
    torch.load(io.BytesIO(torch_payload(marker)), weights_only=False)
    assert marker.exists()


@pytest.mark.slow
def test_a_second_writer_is_refused_and_a_killed_holder_does_not_block(cli, tiny_overrides, tmp_path):
    """Two real `flopwise train` processes on one run directory: the second is refused with the
    holder's pid; after the holder is SIGKILLed, the same command resumes."""
    run = tmp_path / "run"
    args = ["train", *tiny_overrides, *QUIET, "train.max_steps=100000", "train.checkpoint_every=2",
            f"train.run_dir={run}"]
    holder = subprocess.Popen([sys.executable, "-m", "flopwise", *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(2400):  # until it has saved a checkpoint (however slow the machine)
            if list_checkpoints(run) or holder.poll() is not None:
                break
            time.sleep(0.05)
        assert holder.poll() is None and list_checkpoints(run), holder.stderr.read() if holder.poll() else "no save"
        second = cli(*args[:-2], "train.max_steps=4", f"train.run_dir={run}")
        assert second.returncode == 2
        assert f"pid {holder.pid}" in second.stderr and "in use by another process" in second.stderr, second.stderr
        assert "intact" not in second.stderr  # it touched nothing, so it says nothing about checkpoints
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stderr.close()
    saved = latest_checkpoint(run)
    last = int(saved.name[5:])
    resumed = cli(*args[:-2], f"train.max_steps={last + 2}", f"train.run_dir={run}")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {saved}" in resumed.stdout
    assert latest_checkpoint(run).name == f"step-{last + 2:07d}"


def test_the_lock_refuses_a_second_holder_in_another_process(tmp_path):
    held = DirLock(tmp_path / "d", "test").acquire()
    code = ("import sys; from flopwise.fsio import DirLock, LockedError\n"
            "try:\n    DirLock(sys.argv[1], 'other').acquire()\nexcept LockedError as e:\n    print(e); sys.exit(3)\n")
    other = subprocess.run([sys.executable, "-c", code, str(tmp_path / "d")], capture_output=True, text=True)
    assert other.returncode == 3 and f"pid {os.getpid()}" in other.stdout, other.stdout + other.stderr
    held.release()
    assert subprocess.run([sys.executable, "-c", code, str(tmp_path / "d")]).returncode == 0
    with pytest.raises(LockedError):  # two opens in one process conflict too (flock is per open file)
        with DirLock(tmp_path / "d", "a"), DirLock(tmp_path / "d", "b"):
            pass


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.slow
def test_a_full_disk_during_a_training_save(cli, tiny_overrides, small_fs, tmp_path, fill_fs):
    """The run directory on a real tmpfs with room for one checkpoint: the second save fails with
    the real error; the message says so and names the intact checkpoint; nothing partial is left;
    with space freed, the same command resumes from it."""
    args = [*tiny_overrides, *QUIET, "train.checkpoint_every=3", "train.keep_checkpoints=0"]
    probe = cli("train", *[a for a in args if not a.startswith("train.run_dir=")], "train.max_steps=3",
                f"train.run_dir={tmp_path / 'probe'}")
    assert probe.returncode == 0, probe.stderr
    one = _du(tmp_path / "probe" / "checkpoints")
    fs = small_fs(f"{(3 * one + (1 << 20)) // 1024}k")
    run = fs / "run"
    first = cli("train", *args, "train.max_steps=3", f"train.run_dir={run}")
    assert first.returncode == 0, first.stderr
    fill_fs(fs, one // 2)  # room for half a checkpoint
    full = cli("train", *args, "train.max_steps=6", f"train.run_dir={run}")
    assert full.returncode == 2, full.stdout + full.stderr
    assert "could not save checkpoint step 6" in full.stderr and "no space left on the device" in full.stderr
    assert f"{run / 'checkpoints' / 'step-0000003'} is intact" in full.stderr
    assert "Traceback" not in full.stderr
    leftovers = [p.name for p in run.rglob("*") if p.name.startswith(".") and p.name != ".lock"]
    assert leftovers == [], f"left on the full disk: {leftovers}"
    assert [p.name for p in list_checkpoints(run)] == ["step-0000003"]
    (fs / "ballast").unlink()
    again = cli("train", *args, "train.max_steps=6", f"train.run_dir={run}")
    assert again.returncode == 0, again.stderr
    assert latest_checkpoint(run).name == "step-0000006"


def test_a_full_disk_before_the_run_is_refused_and_leaves_nothing(tiny_overrides, small_fs, fill_fs):
    fs = small_fs("256k")
    fill_fs(fs, 0)
    cfg = build_config(overrides=tiny_overrides + QUIET + ["train.max_steps=2", f"train.run_dir={fs / 'run'}"])
    with pytest.raises(ConfigError, match="is not writable: no space left on the device"):
        train(cfg, log=lambda s: None)
    assert sorted(p.name for p in fs.iterdir()) == ["ballast"]  # no run dir, no .write-test-*, no .lock


def test_an_atomic_write_on_a_full_disk_keeps_the_old_file(small_fs, fill_fs):
    fs = small_fs("128k")
    write_file(fs / "config.yaml", "model: {old: 1}\n")
    fill_fs(fs, 0)
    with pytest.raises(WriteError, match=f"cannot write {fs / 'config.yaml'}: no space left on the device; "
                                         "the earlier config.yaml is unchanged"):
        write_file(fs / "config.yaml", "x" * 200_000)
    assert (fs / "config.yaml").read_text() == "model: {old: 1}\n"
    assert sorted(p.name for p in fs.iterdir()) == ["ballast", "config.yaml"]


def test_a_cut_config_yaml_resumes_from_the_checkpoints_copy(tiny_overrides):
    overrides = tiny_overrides + QUIET + ["train.checkpoint_every=2"]
    first = train(build_config(overrides=overrides + ["train.max_steps=2"]), log=lambda s: None)
    cfg_file = first.run_dir / "config.yaml"
    cfg_file.write_text(cfg_file.read_text()[:40])  # what an interrupted in-place write left
    notes = []
    resumed = train(build_config(overrides=overrides + ["train.max_steps=4"]), log=notes.append)
    assert resumed.steps == 4
    # the run's manifest knows its size: the cut is named as such, before YAML is asked to read it
    assert any("config.yaml was changed since the run wrote it" in n and "truncated" in n
               and "step-0000002/config.yaml" in n for n in notes), notes
    assert yaml.safe_load(cfg_file.read_text())["model"]["d_model"] == 64  # rewritten whole


def test_an_unmarked_newest_checkpoint_is_refused_everywhere(tiny_overrides, tmp_path):
    overrides = tiny_overrides + QUIET + ["train.checkpoint_every=2"]
    first = train(build_config(overrides=overrides + ["train.max_steps=4"]), log=lambda s: None)
    newest = latest_checkpoint(first.run_dir)
    (newest / "COMPLETE").unlink()
    with pytest.raises(ConfigError, match=f"{newest}.*no COMPLETE marker.*flopwise checkpoint adopt"):
        train(build_config(overrides=overrides + ["train.max_steps=6"]), log=lambda s: None)
    with pytest.raises(ModelSourceError, match="no COMPLETE marker"):
        flopwise.load(first.run_dir)
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        flopwise.load(newest)


@pytest.mark.slow
def test_flopwise_checkpoint_adopt_and_verify(cli, tiny_overrides):
    overrides = tiny_overrides + QUIET + ["train.max_steps=2"]
    first = train(build_config(overrides=overrides), log=lambda s: None)
    ckpt = latest_checkpoint(first.run_dir)
    (ckpt / "COMPLETE").unlink()
    refused = cli("checkpoint", "verify", str(ckpt))
    assert refused.returncode == 2 and "no COMPLETE marker" in refused.stderr
    adopted = cli("checkpoint", "adopt", str(ckpt))
    assert adopted.returncode == 0 and "adopted" in adopted.stdout, adopted.stderr
    ok = cli("checkpoint", "verify", str(ckpt))
    assert ok.returncode == 0 and "files match the manifest" in ok.stdout and "step 2" in ok.stdout
