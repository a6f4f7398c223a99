"""What a new user met first (issue 19): a finished run run again, a finished run extended,
the end-of-run sample's prompt, and an option put in the wrong section. CPU, the tiny model
on the small corpus."""

import json
import shutil

import pytest

from flopwise.checkpoints import list_checkpoints
from flopwise.config import ConfigError, build_config
from flopwise.data.datadir import open_data_dir
from flopwise.train.hooks import validation_prompt
from flopwise.train.schedule import lr_at, resumed_schedule
from flopwise.train.trainer import train

QUIET = ["eval.every=0", "eval.sample_tokens=0", "train.log_every=1", "train.keep_checkpoints=0"]


def rates(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in rows if r.get("lr") is not None and "event" not in r}


def snapshot(run_dir) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


@pytest.mark.slow
def test_a_finished_run_run_again_says_so_and_changes_nothing(cli, tiny_overrides, tmp_path):
    args = tiny_overrides + ["train.max_steps=6", "eval.sample_tokens=8"]
    first = cli("train", *args)
    assert first.returncode == 0, first.stderr
    run = tmp_path / "run"
    before = snapshot(run)
    again = cli("train", *args)
    assert again.returncode == 0, again.stderr
    assert "finished" in again.stdout and "already holds all 6 steps" in again.stdout
    assert "nan" not in again.stdout
    assert snapshot(run) == before  # run.json, metrics, config, samples, checkpoints: untouched
    result = json.loads((run / "run.json").read_text())["result"]
    assert result["final_loss"] == result["final_loss"] and result["tok_per_s"] is not None  # not NaN / null


def test_extending_a_finished_run_does_not_raise_the_rate(tiny_overrides, tmp_path):
    run = tmp_path / "run"
    base = tiny_overrides + QUIET + ["train.checkpoint_every=2"]
    train(build_config(overrides=base + ["train.max_steps=10"]), log=lambda s: None)
    floor = rates(run)[10]
    logged = []
    train(build_config(overrides=base + ["train.max_steps=14"]), log=logged.append)
    lr = rates(run)
    assert [lr[s] for s in range(11, 15)] == [floor] * 4  # held at the floor the 10-step cosine reached
    note = next(line for line in logged if line.strip().startswith("schedule"))
    assert "length 10 -> 14 steps" in note and "held at" in note
    # The continuation is in the checkpoints: a later resume at the same length follows it exactly.
    again = tmp_path / "again"
    shutil.copytree(run, again)
    for p in list_checkpoints(again):
        if int(p.name[5:]) > 12:
            shutil.rmtree(p)
    train(build_config(overrides=base + ["train.max_steps=14", f"train.run_dir={again}"]), log=lambda s: None)
    assert rates(again) == lr


def test_extending_mid_decay_continues_the_decay_from_where_it_was(tiny_overrides, tmp_path):
    run = tmp_path / "run"
    base = tiny_overrides + QUIET + ["train.checkpoint_every=7"]
    cfg10 = build_config(overrides=base + ["train.max_steps=10"])
    train(cfg10, log=lambda s: None)
    shutil.rmtree(list_checkpoints(run)[-1])  # as if it had stopped after its step-7 save
    train(build_config(overrides=base + ["train.max_steps=16"]), log=lambda s: None)
    lr = rates(run)
    o = cfg10.optim
    assert lr[7] == lr_at(6, 10, o)
    steps = [lr[s] for s in range(7, 17)]
    assert all(a > b for a, b in zip(steps, steps[1:]))  # decreasing: never back up
    assert lr[16] == pytest.approx(o.lr * o.min_lr_ratio)
    assert lr[8] > lr_at(7, 10, o)  # slower than the old schedule: it now ends at step 16


def test_wsd_in_its_stable_phase_just_moves_its_decay(tiny_overrides, tmp_path):
    cfg = build_config(overrides=tiny_overrides + ["optim.schedule=wsd", "train.max_steps=40"])
    ckpt = tmp_path / "step-0000010"
    ckpt.mkdir()
    (ckpt / "config.yaml").write_text(build_config(overrides=tiny_overrides + ["optim.schedule=wsd",
                                                                               "train.max_steps=30"]).to_yaml())
    cont, note = resumed_schedule(ckpt, {}, 10, 40, cfg, ramped=False)  # old decay from step 24: not begun
    assert cont is None and "decay now ends at step 40" in note
    same, note = resumed_schedule(ckpt, {}, 10, 30, build_config(overrides=tiny_overrides + [
        "optim.schedule=wsd", "train.max_steps=30"]), ramped=False)
    assert same is None and note == ""  # an unchanged length: the schedule as it was


def test_a_batch_ramped_run_cannot_change_its_length(tiny_overrides, tmp_path):
    ramp = ["train.batch_ramp_tokens=20000", "train.max_steps=0"]
    ckpt = tmp_path / "step-0000005"
    ckpt.mkdir()
    (ckpt / "config.yaml").write_text(build_config(overrides=tiny_overrides + ramp + ["train.max_tokens=60000"])
                                      .to_yaml())
    cfg = build_config(overrides=tiny_overrides + ramp + ["train.max_tokens=90000"])
    with pytest.raises(ConfigError, match="train.max_tokens=60000"):
        resumed_schedule(ckpt, {}, 5, 20, cfg, ramped=True)


def test_the_sample_starts_from_a_validation_document(small_builtin, tiny_overrides, tmp_path):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=2", "eval.every=0"])
    data = open_data_dir(cfg.data, log=lambda s: None)
    ids = validation_prompt(data)
    assert ids == validation_prompt(data) and len(ids) == 12 and data.eos_id not in ids
    prompt = data.tokenizer.decode(ids)
    train(cfg, log=lambda s: None)
    header = (tmp_path / "run" / "samples.txt").read_text().splitlines()[0]
    assert header.startswith(f"--- prompt {prompt!r} (the start of a validation document)")
    assert "'def '" not in header
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=2", "eval.every=0", "eval.sample_prompt=import",
                                                   f"train.run_dir={tmp_path / 'asked'}"])
    train(cfg, log=lambda s: None)
    assert (tmp_path / "asked" / "samples.txt").read_text().startswith("--- prompt 'import' (eval.sample_prompt)")


def test_an_option_in_the_wrong_section_names_the_right_one():
    with pytest.raises(ConfigError) as err:
        build_config(overrides=["train.lr=1e-3", "optim.max_steps=5", "train.min_lr=0.1"])
    text = str(err.value)
    assert "unknown key train.lr (did you mean 'optim.lr'?)" in text
    assert "unknown key optim.max_steps (did you mean 'train.max_steps'?)" in text
    assert "unknown key train.min_lr (did you mean 'optim.min_lr_ratio'?)" in text


def test_a_model_vocabulary_larger_than_the_datas_is_noted_at_the_start(tiny_overrides):
    """A user who prepared a corpus with a 512-token BPE and trained a preset built for 8,192
    saw a first loss of 9.0 under "uniform ln V = 6.2" and no word why."""
    lines = []
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=1", "model.vocab_size=8192", *QUIET])
    train(cfg, log=lines.append)
    note = [ln for ln in lines if "model.vocab_size 8,192 is larger than the data's vocabulary 512" in ln]
    assert note and "model.vocab_size=512 fits the data" in note[0], lines[:6]
    from flopwise.train.describe import unused_vocab_note

    assert unused_vocab_note(50_304, 50_257, 768) == ""  # GPT-2's padding to a multiple of 64 is not waste
    assert unused_vocab_note(512, 512, 64) == ""


def test_validation_windows_that_overlap_are_said_to(tiny_overrides, tmp_path, cli):
    """eval.windows windows on a validation split smaller than they need: the
    start-up summary and `flopwise eval` say the windows overlap and by how much."""
    from flopwise.data.loader import overlap_note

    assert overlap_note(4, 63, 256) == "" and "each token scored ~2.0x" in overlap_note(8, 63, 256)
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=1", *QUIET])
    val = open_data_dir(cfg.data, log=lambda s: None).num_tokens("val")
    windows = 8 * -(-2 * val // (64 * 8))  # windows enough to score each validation token about twice
    lines = []
    train(build_config(overrides=tiny_overrides + ["train.max_steps=1", *QUIET, f"eval.windows={windows}"]),
          log=lines.append)
    assert any(f"NOTE: validation: {windows:,} windows need" in ln and "so they overlap" in ln for ln in lines)
    proc = cli("eval", str(tmp_path / "run"), "--windows", "4")
    assert proc.returncode == 0 and "overlap" not in proc.stdout, proc.stdout + proc.stderr
    proc = cli("eval", str(tmp_path / "run"), "--windows", str(windows))
    assert proc.returncode == 0 and "so they overlap (each token scored ~2." in proc.stdout, proc.stdout
