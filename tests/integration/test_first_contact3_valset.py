"""The validation set is fixed in windows, whatever the micro-batch (issue 45, item 3).

It was ``eval.batches x train.micro_batch_size`` windows, so a preflight that chose a smaller
micro-batch cut the held-out set (128 windows to 32), and runs overlaid in a report were
validated on different subsets. ``eval.windows`` is the set; the micro-batch only batches
its forwards. An old configuration's ``eval.batches`` still loads, as the windows it meant
(its count x the micro-batch written beside it), with a note; an old run resumed at another
micro-batch, its ``flopwise eval`` and its export keep the set it validated on."""

import json
import re

import pytest
import yaml

from flopwise.cli import main as cli_main
from flopwise.manifest import file_entry
from tests.helpers import tiny_model_overrides

VAL = re.compile(r"val +loss ([0-9.]+) .*\((\d+) windows x (\d+) tokens: (.*)\)")
QUIET = ["eval.every=0", "eval.sample_tokens=0", "train.log_every=1", "tracking.tensorboard=false"]


def _model(cache) -> list[str]:
    """The tiny model on the small corpus, with no validation setting of the test's own: the
    preset's set is the one under test."""
    return [o for o in tiny_model_overrides(cache) if not o.startswith("eval.")]


def _state(run, step: int) -> dict:
    return json.loads((run / "checkpoints" / f"step-{step:07d}" / "state.json").read_text())


def _val_rows(run) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("val_loss") is not None]


def test_the_validation_set_is_the_same_at_any_micro_batch(small_builtin, tmp_path, capsys):
    """A real train at micro-batch 8 and at 2 (what preflight chooses on a smaller GPU): the
    same weights at step 0 are validated on the same number of windows, to the same loss."""
    cache, _ = small_builtin
    got = {}
    for micro in (8, 2):
        run = tmp_path / f"micro{micro}"
        assert cli_main(["train", *_model(cache), *QUIET, "train.max_steps=1", f"train.micro_batch_size={micro}",
                         f"train.run_dir={run}"]) == 0
        got[micro] = (_state(run, 1)["val_windows"], _val_rows(run)[0])
    capsys.readouterr()
    (n8, row8), (n2, row2) = got[8], got[2]
    assert row8["step"] == row2["step"] == 0
    assert n8 == n2 == 128, f"validation windows at micro-batch 8: {n8}, at 2: {n2}"  # the tiny preset's set
    assert row2["val_loss"] == pytest.approx(row8["val_loss"], rel=1e-5)  # batching the forwards is all that differs


def _old_config(path, micro: int, batches: int, cache) -> None:
    """A config file as flopwise wrote them before eval.windows: eval.batches beside its micro-batch."""
    model = {k.split("=")[0]: k.split("=", 1)[1] for k in _model(cache)}
    sections: dict = {}
    for key, value in model.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    sections["train"]["micro_batch_size"] = micro
    sections["eval"] = {"batches": batches}
    path.write_text(yaml.safe_dump(sections))


def test_an_old_config_with_eval_batches_keeps_its_set_at_another_micro_batch(small_builtin, tmp_path, capsys):
    """``eval.batches: 2`` beside micro-batch 8 meant 16 windows: it still does when the command
    line asks for micro-batch 2 (as preflight's printed command does), and says so."""
    cache, _ = small_builtin
    old = tmp_path / "old.yaml"
    _old_config(old, micro=8, batches=2, cache=cache)
    run = tmp_path / "run"
    assert cli_main(["train", "--config", str(old), *QUIET, "train.max_steps=1", "train.micro_batch_size=2",
                     f"train.run_dir={run}"]) == 0
    err = capsys.readouterr().err
    assert _state(run, 1)["val_windows"] == 16
    assert "eval.batches" in err and "eval.windows: 16" in err, err
    assert "windows: 16" in (run / "config.yaml").read_text()  # the run records the new key

    both = tmp_path / "both.yaml"
    both.write_text(old.read_text().replace("batches: 2", "batches: 2\n  windows: 64"))
    assert cli_main(["train", "--config", str(both), f"train.run_dir={tmp_path / 'refused'}"]) == 2
    err = capsys.readouterr().err
    assert "eval.batches" in err and "eval.windows" in err and str(both) in err, err
    assert not (tmp_path / "refused").exists()


def _make_old_run(run) -> None:
    """Rewrite a run's config files as an earlier version wrote them (``eval.batches`` instead of
    ``eval.windows``, no checksum line): an old run, as far as its files tell."""
    for f in [run / "config.yaml", *(run / "checkpoints").glob("step-*/config.yaml")]:
        text = f.read_text().split("# flopwise sha256")[0].replace("  windows: 16\n", "  batches: 2\n")
        assert "  batches: 2\n" in text, text
        f.write_text(text)
        if f.parent.name.startswith("step-"):  # as that version's manifest recorded it
            manifest = json.loads((f.parent / "COMPLETE").read_text())
            manifest["files"]["config.yaml"] = file_entry(f)
            (f.parent / "COMPLETE").write_text(json.dumps(manifest))


def test_an_old_run_resumed_at_a_smaller_micro_batch_keeps_its_set_in_train_eval_and_export(small_builtin, tmp_path,
                                                                                              capsys):
    cache, _ = small_builtin
    run = tmp_path / "run"
    common = [*_model(cache), *QUIET, "eval.every=2", f"train.run_dir={run}"]
    assert cli_main(["train", *common, "train.max_steps=2", "eval.batches=2"]) == 0
    _make_old_run(run)
    # resumed from its config.yaml at micro-batch 2, as preflight would suggest
    assert cli_main(["train", "--config", str(run / "config.yaml"), "train.max_steps=4",
                     "train.micro_batch_size=2"]) == 0
    capsys.readouterr()
    assert _state(run, 4)["val_windows"] == 16
    trained = _val_rows(run)[-1]
    assert trained["step"] == 4

    assert cli_main(["eval", str(run)]) == 0
    loss, n, T, why = VAL.search(out := capsys.readouterr().out).groups()
    assert (int(n), int(T)) == (16, 64), out
    assert "eval.windows" in why, why
    assert float(loss) == pytest.approx(trained["val_loss"], abs=2e-4)
    assert json.loads((run / "evals.jsonl").read_text().splitlines()[-1])["val_set"] == "run"

    pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    assert cli_main(["export", str(run), str(hf)]) == 0
    rec = json.loads((hf / "flopwise.json").read_text())["validation"]
    assert rec["windows"] == 16, rec

    # another eval.windows at a resume is said, and the run keeps the set it started with
    assert cli_main(["train", "--config", str(run / "config.yaml"), "train.max_steps=5", "eval.windows=8"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"validation +16 windows, the set this run validated on from its start \(eval.windows 8 ", out), out
    assert _state(run, 5)["val_windows"] == 16


def test_eval_batches_is_read_with_the_micro_batch_of_its_own_layer(tmp_path):
    """Within one layer the order of keys does not matter; a later layer's micro-batch does not
    move the set; a bad count names the key that replaced it."""
    from flopwise.config import ConfigError, build_config

    f = tmp_path / "eval_first.yaml"
    f.write_text("eval:\n  batches: 3\ntrain:\n  micro_batch_size: 4\n  global_batch_size: 32\n")
    cfg = build_config(config_file=f, overrides=["train.micro_batch_size=2"])
    assert cfg.eval.windows == 12 and cfg.train.micro_batch_size == 2
    assert any("eval.batches (3" in n and "eval.windows: 12" in n for n in cfg.notes), cfg.notes
    assert build_config(overrides=["eval.batches=2", "train.micro_batch_size=4"]).eval.windows == 8
    assert build_config().eval.windows == 128 and not build_config().notes  # the tiny preset: today's count
    for bad, says in (("eval.batches=0", "eval.batches must be > 0"), ("eval.windows=0", "eval.windows must be > 0"),
                      ("eval.windows=100000000", "give fewer eval.windows")):
        with pytest.raises(ConfigError, match=says):
            build_config(overrides=[bad])
