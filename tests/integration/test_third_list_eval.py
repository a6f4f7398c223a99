"""`flopwise eval` and `flopwise report` against the third adversarial list (issue 44): eval
checks the data fingerprint on every path, records which data and windows each row used and
records only into a real run, refuses what the model cannot read (a larger vocabulary, longer
windows) and a steering or malformed ``flopwise.json``; the report reads a run's config.yaml
through the bounded reader, bounds what it renders, and plots only like with like."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flopwise.cli import main as cli_main

TINY = ["model.vocab_size=512", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
        "model.ffn_hidden=64", "model.max_seq_len=32", "train.seq_len=32", "train.micro_batch_size=2",
        "train.global_batch_size=2", "train.checkpoint_every=2", "train.max_steps=2", "eval.every=0",
        "eval.windows=4", "eval.sample_tokens=0", "tracking.tensorboard=false"]
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def write_corpus(path: Path, n_docs: int, offset: int = 0) -> Path:
    """``n_docs`` JSONL documents; another ``offset`` gives other text (and another fingerprint)."""
    with open(path, "w") as f:
        for i in range(n_docs):
            words = [WORDS[(i * 7 + j * (3 + offset)) % len(WORDS)] for j in range(20 + i % 30)]
            f.write(json.dumps({"text": f"doc {i + offset}: " + " ".join(words)}) + "\n")
    return path


def prepare(corpus: Path, out: Path, vocab: int = 300, *extra: str) -> Path:
    rc = cli_main(["prepare", str(corpus), "--vocab-size", str(vocab), "--out", str(out), "--val-tokens", "400",
                   "--workers", "1", *extra])
    assert rc == 0
    return out


def train_run(data: Path, run: Path) -> Path:
    assert cli_main(["train", f"data.path={data}", f"train.run_dir={run}", f"data.cache_dir={run.parent / 'cache'}",
                     *TINY]) == 0
    return run


def flopwise(*args, timeout: float = 600, memory: int = 4 << 30):
    """``python -m flopwise ARGS`` under an address-space limit: a regression that expands
    something unbounded fails with a MemoryError instead of taking the shared machine's memory."""
    import resource

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "flopwise", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (memory, memory)))


def rows(run: Path) -> list[dict]:
    path = run / "evals.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run trained on a prepared data directory, and a second, different data directory."""
    root = tmp_path_factory.mktemp("third-list-eval")
    data = prepare(write_corpus(root / "a.jsonl", 300), root / "data")
    other = prepare(write_corpus(root / "b.jsonl", 300, offset=5), root / "other")
    run = train_run(data, root / "run")
    return root, run, data, other


@pytest.fixture
def run_copy(trained, tmp_path):
    """A copy of the trained run to write evals.jsonl into (its config points at the same data)."""
    _, run, data, other = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy, data, other


# --------------------------------------------------------------------------- item 2

def test_eval_of_a_run_refuses_data_prepared_again_since_and_records_nothing(tmp_path, capsys):
    data = prepare(write_corpus(tmp_path / "a.jsonl", 300), tmp_path / "data")
    run = train_run(data, tmp_path / "run")
    prepare(write_corpus(tmp_path / "b.jsonl", 300, offset=5), data, 300, "--overwrite")  # the same directory
    capsys.readouterr()
    assert cli_main(["train", "--config", str(run / "config.yaml"), "train.max_steps=4"]) == 2
    assert "the data changed since the checkpoint" in capsys.readouterr().err  # train refuses to resume
    assert cli_main(["eval", str(run)]) == 2
    err = capsys.readouterr().err
    assert "not the data the run trained on" in err and str(data) in err, err
    assert not (run / "evals.jsonl").exists()


# --------------------------------------------------------------------------- item 3

ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))


def fake_run(root: Path, name: str, config: str) -> Path:
    d = root / name
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "tokens": 64, "loss": 5.0}) + "\n")
    (d / "config.yaml").write_text(config)
    return d


def test_report_refuses_an_alias_bomb_in_a_runs_config_quickly(tmp_path):
    assert len(ALIAS_BOMB) < 700  # 9^9 values once expanded
    a = fake_run(tmp_path, "a", "model:\n  arch: llama\n")
    b = fake_run(tmp_path, "b", ALIAS_BOMB)
    done = flopwise("report", a, b, "--no-png", timeout=120)  # a regression hangs for minutes: this fails instead
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"{b / 'config.yaml'}" in done.stderr and "alias" in done.stderr, done.stderr


def test_report_bounds_the_values_it_renders_from_a_config(tmp_path, capsys):
    a = fake_run(tmp_path, "a", "model:\n  arch: llama\n")
    b = fake_run(tmp_path, "b", "model:\n  arch: " + "x" * 500_000 + "\n")
    out = tmp_path / "r.html"
    assert cli_main(["report", str(a), str(b), "--no-png", "--out", str(out)]) == 0
    page = out.read_text()
    assert len(page) < 200_000 and "500,000 characters" in page


# --------------------------------------------------------------------------- item 5

def test_eval_rows_say_which_data_and_windows_and_the_report_plots_like_with_like(run_copy, tmp_path, capsys):
    from flopwise.report.report import bpb_chart, loss_chart
    from flopwise.report.runs import load_run

    run, data, other = run_copy
    assert cli_main(["eval", str(run)]) == 0
    assert cli_main(["eval", str(run), "--data", str(other), "--other-data"]) == 0
    assert cli_main(["eval", str(run), "--seq-len", "4", "--windows", "8"]) == 0
    own, on_other, short = rows(run)
    fp = json.loads((data / "meta.json").read_text())["fingerprint"]
    other_fp = json.loads((other / "meta.json").read_text())["fingerprint"]
    assert own["val_data"] == {"path": str(data), "fingerprint": fp, "runs": True}
    assert on_other["val_data"] == {"path": str(other), "fingerprint": other_fp, "runs": False}
    assert (own["val_windows"], own["val_seq_len"]) == (4, 32)
    assert (short["val_windows"], short["val_seq_len"]) == (8, 4)
    assert own["val_set"] == "run" and on_other["val_set"] == short["val_set"] == "other"

    with (run / "evals.jsonl").open("a") as f:  # a row from before eval recorded its data: never on the curve
        f.write(json.dumps({k: v for k, v in own.items() if k not in ("val_data", "val_set")}) + "\n")
    loaded = load_run(run)
    loaded.name, loaded.color = "r", "#000000"
    for chart in (loss_chart([loaded]), bpb_chart([loaded])):
        evals = {s.label: s for s in chart.series if "eval" in s.label}
        key = "val_loss" if chart.id == "loss" else "val_bpb"
        on_curve = [s for label, s in evals.items() if label.endswith("val (flopwise eval)")]
        assert len(on_curve) == 1 and list(on_curve[0].y) == [own[key]], evals
        assert len(evals) == 4, list(evals)  # own, other data, other windows, not recorded: each its own series
        labels = " | ".join(evals)
        assert "other" in labels and "8 windows x 4 tokens" in labels and "data not recorded" in labels, labels


# --------------------------------------------------------------------------- item 6

@pytest.fixture
def hf_export(trained, tmp_path):
    pytest.importorskip("transformers")
    _, run, data, _ = trained
    out = tmp_path / "hf"
    assert cli_main(["export", str(run), str(out)]) == 0
    return out, data


def edit_record(hf: Path, **validation) -> None:
    """Set ``validation.KEY`` of ``flopwise.json``; ``data_KEY``: ``validation.data.KEY``."""
    rec = json.loads((hf / "flopwise.json").read_text())
    for key, value in validation.items():
        if key.startswith("data_"):
            rec["validation"]["data"][key[5:]] = value
        else:
            rec["validation"][key] = value
    (hf / "flopwise.json").write_text(json.dumps(rec))


def test_an_exports_record_never_chooses_a_cache_folder(hf_export, tmp_path, capsys):
    hf, _ = hf_export
    steered = tmp_path / "elsewhere" / "cache"
    edit_record(hf, data_cache_dir=str(steered))
    assert cli_main(["eval", str(hf)]) == 0
    assert "val        loss" in capsys.readouterr().out
    assert not steered.parent.exists()


def test_an_exports_record_with_another_fingerprint_is_refused(hf_export, capsys):
    hf, _ = hf_export
    rec = json.loads((hf / "flopwise.json").read_text())
    rec["validation"]["data_fingerprint"] = "0" * 64  # the run's data, recorded as another corpus
    (hf / "flopwise.json").write_text(json.dumps(rec))
    assert cli_main(["eval", str(hf)]) == 2
    err = capsys.readouterr().err
    assert "not the data the run trained on" in err and "--other-data" in err, err


@pytest.mark.parametrize("field, value, said", [
    ("windows", "abc", "'abc'"), ("windows", -5, "-5"), ("windows", 10**12, "1,000,000,000,000"),
    ("seq_len", 0, "0"), ("windows", True, "True"), ("data_path", 7, "7"), ("data_builtin_vocab_size", "x", "'x'"),
])
def test_a_malformed_export_record_is_named_not_a_traceback(hf_export, field, value, said, capsys):
    hf, _ = hf_export
    edit_record(hf, **{field: value})
    assert cli_main(["eval", str(hf)]) == 2
    err = capsys.readouterr().err
    name = field.replace("data_", "data.")
    assert f"{hf / 'flopwise.json'}" in err and f"validation.{name}" in err and said in err, err


def test_twenty_million_windows_are_refused_from_the_record_and_the_flag(hf_export, capsys):
    """The issue's figure (19 GiB asked for), run under an address-space limit (:func:`flopwise`)."""
    from flopwise.cli import build_parser

    hf, _ = hf_export
    with pytest.raises(SystemExit):  # the flag: refused by the parser, before anything is loaded
        build_parser().parse_args(["eval", str(hf), "--windows", "20000000"])
    assert "--windows" in capsys.readouterr().err
    edit_record(hf, windows=20_000_000)
    done = flopwise("eval", hf)
    assert done.returncode == 2 and "validation.windows: 20,000,000" in done.stderr, done.stderr[-2000:]


# --------------------------------------------------------------------------- item 9

def test_an_export_or_a_copied_checkpoint_is_not_recorded_two_folders_up(trained, tmp_path, capsys):
    _, run, _, _ = trained
    pt = tmp_path / "a" / "b" / "pt"
    assert cli_main(["export", str(run), str(pt), "--format", "pt"]) == 0
    copied = tmp_path / "c" / "d" / "step-0000002"
    shutil.copytree(run / "checkpoints" / "step-0000002", copied)
    for source, two_up in ((pt, tmp_path / "a"), (copied, tmp_path / "c")):
        capsys.readouterr()
        assert cli_main(["eval", str(source)]) == 0
        out = capsys.readouterr().out
        assert not (two_up / "evals.jsonl").exists()
        assert "not recorded" in out and "val        loss" in out, out


def test_a_checkpoint_inside_its_run_is_still_recorded(run_copy, capsys):
    run, _, _ = run_copy
    assert cli_main(["eval", str(run / "checkpoints" / "step-0000002")]) == 0
    assert [r["step"] for r in rows(run)] == [2] and "appended to" in capsys.readouterr().out


# --------------------------------------------------------------------------- item 15 and "also noticed"

@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory) -> Path:
    """A data directory whose BPE has more tokens than the tiny model's 512, its ids used."""
    root = tmp_path_factory.mktemp("big-vocab")
    corpus = root / "c.jsonl"  # many distinct words: a BPE of 2,000 tokens uses ids far beyond 512
    corpus.write_text("".join(json.dumps({"text": " ".join(f"w{(i * 7919 + j * 104729) % 99991:x}q"
                                                           for j in range(60))}) + "\n" for i in range(400)))
    return prepare(corpus, root / "big", 2000)


def test_data_with_a_larger_vocabulary_than_the_model_is_refused_before_work(trained, big_vocab, capsys):
    _, run, _, _ = trained
    big = big_vocab
    vocab = json.loads((big / "meta.json").read_text())["vocab_size"]
    assert vocab > 512
    capsys.readouterr()
    assert cli_main(["eval", str(run), "--data", str(big), "--other-data"]) == 2
    err = capsys.readouterr().err
    assert "vocabulary" in err and f"{vocab:,}" in err and "512" in err, err


def test_windows_longer_than_the_model_reads_are_refused(trained, capsys):
    _, run, _, _ = trained
    assert cli_main(["eval", str(run), "--seq-len", "64"]) == 2
    err = capsys.readouterr().err
    assert "--seq-len 64" in err and "max_seq_len" in err and "32" in err, err


def test_other_data_without_data_is_an_error_naming_the_flag(trained, capsys):
    _, run, _, _ = trained
    assert cli_main(["eval", str(run), "--other-data"]) == 2
    err = capsys.readouterr().err
    assert "--other-data" in err and "--data" in err, err


def test_a_tokenizer_larger_than_the_model_is_refused_before_the_tasks(hf_export, big_vocab, tmp_path, capsys):
    hf, _ = hf_export
    shutil.copyfile(big_vocab / "tokenizer.json", hf / "tokenizer.json")  # another model's tokenizer
    quiz = tmp_path / "quiz.jsonl"
    quiz.write_text("".join(json.dumps({"context": f"w{i:x}q w{i * 31:x}q", "choices": [" w1q", " wffq"],
                                        "label": 0}) + "\n" for i in range(40)))
    assert cli_main(["eval", str(hf), "--task-data", f"quiz={quiz}"]) == 2
    err = capsys.readouterr().err
    assert f"{hf / 'tokenizer.json'}" in err and "vocabulary" in err and "512" in err, err
