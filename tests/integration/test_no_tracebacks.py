"""Bad input and faults end in one clear line, never a traceback: a table of the cases users
met (malformed files they were sent, impossible values, a wrong argument to each subcommand),
each fed to the real command line. Each must exit 2 with its message -- ``flopwise COMMAND:``
and what is wrong, in one line (a config error lists its problems below its first line) --
naming the file, field or value, and print no traceback.

The cases run in this process through ``flopwise.cli.main`` (a traceback would be an exception
escaping it), so the table stays cheap; ``test_a_bug_keeps_its_traceback_and_debug_shows_ours``
checks the same boundary through a real process. Full and read-only disks are in
``test_write_faults.py``, a dying rank in ``tests/distributed/test_rank_death.py``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flopwise.cli import main

WHAT = {}  # case id -> (argv builder, phrase the line must hold)


def case(name: str, phrase: str):
    def register(build):
        WHAT[name] = (build, phrase)
        return build
    return register


@pytest.fixture(scope="module")
def world(small_builtin, tmp_path_factory):
    """A tiny trained run, its Hugging Face export and a copy of its data directory, to spoil."""
    from flopwise.config import build_config
    from flopwise.model.io import export_hf
    from flopwise.train.trainer import train

    cache, data = small_builtin
    root = tmp_path_factory.mktemp("spoil")
    run = root / "run"
    train(build_config(overrides=[
        f"data.path={data}", "model.vocab_size=512", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
        "model.n_kv_heads=1", "model.ffn_hidden=64", "model.max_seq_len=32", "train.seq_len=32",
        "train.micro_batch_size=2", "train.global_batch_size=2", "train.max_steps=2", "eval.every=0",
        "eval.windows=2", "eval.sample_tokens=0", f"train.run_dir={run}"]), log=lambda s: None)
    export_hf(run, root / "hf")
    return {"root": root, "run": run, "hf": root / "hf", "data": Path(data)}


def _hf_with(world, name: str, **changes) -> Path:
    out = world["root"] / name
    if not out.exists():
        shutil.copytree(world["hf"], out)
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(changes)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def _data_with(world, name: str, file: str, content: bytes) -> Path:
    out = world["root"] / name
    if not out.exists():
        shutil.copytree(world["data"], out)
        (out / file).write_bytes(content)
    return out


NESTED = b"[" * 100_000 + b"]" * 100_000


# ---------------------------------------------------------------- files a user was sent

@case("config yaml not utf-8", "bad.yaml")
def _(w):
    (w["root"] / "bad.yaml").write_bytes(b"train:\n  seed: \xff\xfe\n")
    return ["train", "--config", str(w["root"] / "bad.yaml")]


@case("yaml alias bomb", "alias")
def _(w):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 11)]
    (w["root"] / "bomb.yaml").write_text("\n".join(lines) + "\ntrain:\n  seed: *a10\n")  # ~650 bytes, 10^11 values
    return ["train", "--config", str(w["root"] / "bomb.yaml")]


@case("config yaml not yaml", "broken.yaml")
def _(w):
    (w["root"] / "broken.yaml").write_text("train: [1, 2\n  seed: {")
    return ["plan", "--config", str(w["root"] / "broken.yaml"), "--gpu", "h100"]


@case("meta.json nested", "meta.json")
def _(w):
    return ["prepare", "--verify", str(_data_with(w, "nested-meta", "meta.json", NESTED))]


@case("meta.json nested, train", "meta.json")
def _(w):
    return ["train", f"data.path={_data_with(w, 'nested-meta', 'meta.json', NESTED)}", "model.vocab_size=512"]


@case("tokenizer.json malformed", "bad-tokenizer.json")
def _(w):
    (w["root"] / "bad-tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 3}}')
    (w["root"] / "texts").mkdir(exist_ok=True)
    (w["root"] / "texts" / "a.txt").write_text("some text to tokenize\n" * 50)
    return ["prepare", str(w["root"] / "texts"), "--out", str(w["root"] / "never"),
            "--tokenizer", str(w["root"] / "bad-tokenizer.json")]


@case("task file nested", "nested.jsonl")
def _(w):
    (w["root"] / "nested.jsonl").write_bytes(NESTED + b"\n")
    return ["eval", str(w["run"]), "--tasks", "mine", "--task-data", f"mine={w['root'] / 'nested.jsonl'}"]


@case("hf config.json nested", "config.json")
def _(w):
    out = w["root"] / "hf-nested"
    if not out.exists():
        shutil.copytree(w["hf"], out)
        (out / "config.json").write_bytes(NESTED)
    return ["eval", str(out)]


# ---------------------------------------------------------------- impossible model configs

@case("hf zero heads, eval", "num_attention_heads")
def _(w):
    return ["eval", str(_hf_with(w, "hf-heads0", num_attention_heads=0))]


@case("hf zero heads, train", "num_attention_heads")
def _(w):
    return ["train", f"model.hf_config={_hf_with(w, 'hf-heads0', num_attention_heads=0)}", "train.max_steps=1"]


@case("hf width as a string, generate", "hidden_size")
def _(w):
    return ["generate", str(_hf_with(w, "hf-str", hidden_size="64")), "--max-tokens", "2"]


@case("hf 256 TB of weights, export", "parameters")
def _(w):
    return ["export", str(_hf_with(w, "hf-huge", hidden_size=2**22, intermediate_size=2**24, num_hidden_layers=4096)),
            str(w["root"] / "huge-out")]


@case("hf rope_theta NaN, generate", "rope_theta")
def _(w):
    out = _hf_with(w, "hf-nan", rope_theta=12345.0)  # transformers 5 writes it under rope_parameters
    (out / "config.json").write_text((out / "config.json").read_text().replace("12345.0", "NaN"))
    return ["generate", str(out), "--max-tokens", "2"]


# ---------------------------------------------------------------- values out of range

@case("seed beyond 64 bits", "train.seed")
def _(w):
    return ["train", "train.seed=99999999999999999999999", "train.max_steps=1"]


@case("run directory name past 255 bytes", "train.run_dir")
def _(w):
    return ["train", f"train.run_dir={w['root'] / ('r' * 300)}", "train.max_steps=1"]


@case("vocab of 3", "--vocab-size")
def _(w):
    (w["root"] / "texts").mkdir(exist_ok=True)
    (w["root"] / "texts" / "a.txt").write_text("some text to tokenize\n" * 50)
    return ["prepare", str(w["root"] / "texts"), "--out", str(w["root"] / "never"), "--vocab-size", "3"]


@case("a model the machine cannot hold", "GiB")
def _(w):
    return ["train", "model.d_model=65536", "model.n_layers=200", "model.n_heads=512", "model.n_kv_heads=512",
            "model.ffn_hidden=131072", "train.max_steps=1", f"train.run_dir={w['root'] / 'never-run'}"]


# ---------------------------------------------------------------- each subcommand's arguments

@case("train unknown option", "--bogus")
def _(w):
    return ["train", "--bogus"]


@case("eval no such run", "no-such-run")
def _(w):
    return ["eval", str(w["root"] / "no-such-run")]


@case("generate no such run", "no-such-run")
def _(w):
    return ["generate", str(w["root"] / "no-such-run")]


@case("export no such run", "no-such-run")
def _(w):
    return ["export", str(w["root"] / "no-such-run"), str(w["root"] / "out")]


@case("report no such run", "no-such-run")
def _(w):
    return ["report", str(w["root"] / "no-such-run")]


@case("checkpoint verify not a checkpoint", "not-a-checkpoint")
def _(w):
    (w["root"] / "not-a-checkpoint").mkdir(exist_ok=True)
    return ["checkpoint", "verify", str(w["root"] / "not-a-checkpoint")]


@case("plan unknown gpu", "h1000")
def _(w):
    return ["plan", "--model", "tiny", "--gpu", "h1000"]


@case("preflight bad choice", "--isolation")
def _(w):
    return ["preflight", "--isolation", "sometimes"]


@case("prepare into its own source", "inside the source")
def _(w):
    (w["root"] / "texts").mkdir(exist_ok=True)
    (w["root"] / "texts" / "a.txt").write_text("some text to tokenize\n" * 50)
    return ["prepare", str(w["root"] / "texts"), "--out", str(w["root"] / "texts" / "data"), "--vocab-size", "300"]


@case("generate temperature nan", "--temperature")
def _(w):
    return ["generate", str(w["run"]), "--temperature", "nan"]


@case("prepare no source", "SOURCE")
def _(w):
    return ["prepare", "--out", str(w["root"] / "never")]


@pytest.mark.parametrize("name", sorted(WHAT))
def test_one_clear_line(name, world, capsys, monkeypatch):
    monkeypatch.chdir(world["root"])
    build, phrase = WHAT[name]
    argv = build(world)
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's usage errors
        status = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("flopwise train: note")]
    assert status == 2, f"{argv} exited {status}: {err[-2000:]}"
    assert lines and lines[0].startswith(f"flopwise {argv[0]}"), err[-2000:]
    assert phrase in err, f"{phrase!r} not named: {err[-2000:]}"
    # one line, or a config error's first line with its problems below it
    assert len(lines) == 1 or all(line.startswith("  - ") for line in lines[1:]), err[-2000:]
    assert len(err) < 2000, f"{len(err)} characters of error"


def test_a_bug_keeps_its_traceback_and_debug_shows_ours(tmp_path):
    """Through a real process: a user error is one line, --debug (or FLOPWISE_DEBUG=1) adds the
    traceback, and an exception that is not a user's error keeps its traceback."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("FLOPWISE_DEBUG", None)

    def run(*args, **extra):
        return subprocess.run([sys.executable, "-m", "flopwise", *args], capture_output=True, text=True,
                              env={**env, **extra}, timeout=300)

    plain = run("plan", "--model", "tiny", "--gpu", "h1000")
    assert plain.returncode == 2 and "Traceback" not in plain.stderr and len(plain.stderr.splitlines()) == 1
    for debug in (run("plan", "--model", "tiny", "--gpu", "h1000", "--debug"),
                  run("plan", "--model", "tiny", "--gpu", "h1000", FLOPWISE_DEBUG="1")):
        assert debug.returncode != 0 and "Traceback" in debug.stderr and "PlanError" in debug.stderr
    bug = subprocess.run([sys.executable, "-c", "import sys; from flopwise import cli; "
                          "cli.cmd_presets = None; sys.exit(cli.main(['presets']))"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bug.returncode != 0 and "Traceback" in bug.stderr
