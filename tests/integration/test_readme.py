"""The README's own-data commands work as written, and their result trains."""

import re
import shlex
from pathlib import Path

from flopwise.cli import main as cli_main
from flopwise.config import build_config
from flopwise.data.datadir import DataDir
from flopwise.train.trainer import train

README = Path(__file__).resolve().parents[2] / "README.md"


def _snippet(name: str, lang: str) -> str:
    text = README.read_text()
    m = re.search(rf"<!-- snippet: {name} -->\s*```{lang}\n(.*?)```", text, flags=re.S)
    assert m, f"README has no {lang} block after <!-- snippet: {name} -->"
    return m.group(1)


def test_prepare_snippet_builds_a_data_directory_that_trains(tmp_path, monkeypatch):
    texts = tmp_path / "my_texts"
    texts.mkdir()
    for i in range(40):
        (texts / f"doc{i:02d}.txt").write_text(
            f"Document {i}. " + " ".join(f"the quick brown fox {j} jumps over the lazy dog" for j in range(30))
        )
    monkeypatch.chdir(tmp_path)
    lines = [line for line in _snippet("prepare", "bash").splitlines() if line.strip()]
    prepare_lines = [line for line in lines if line.startswith("flopwise prepare")]
    assert len(prepare_lines) == 2 and lines[-1].startswith("flopwise train")
    for line in prepare_lines:  # the same commands, with a vocabulary and budget this corpus can fill
        argv = shlex.split(line.replace("--vocab-size 8192", "--vocab-size 400").replace("200K", "500"))
        assert cli_main(argv[1:]) == 0, line

    dd = DataDir(tmp_path / "my_data", verify=True)
    assert dd.vocab_size <= 400 and dd.num_tokens("val") == 500 and dd.num_tokens("train") > 500
    # The train line's data.path and vocabulary override, on a model small enough for a test.
    overrides = [a for a in shlex.split(lines[-1]) if a.startswith(("data.path=", "model.vocab_size="))]
    assert overrides == ["data.path=my_data", "model.vocab_size=8192"]
    cfg = build_config(overrides=[
        "data.path=my_data", "model.vocab_size=400", "model.d_model=32", "model.n_layers=1",
        "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_hidden=64", "train.seq_len=32",
        "train.micro_batch_size=4", "train.global_batch_size=4", "train.max_steps=3", "eval.batches=1",
        "eval.sample_tokens=4", f"train.run_dir={tmp_path / 'run'}",
    ])
    result = train(cfg, log=lambda s: None)
    assert result.steps == 3 and (tmp_path / "run" / "checkpoints" / "step-0000003").is_dir()
