"""The README's own-data recipe works as written, and its result trains."""

import re
from pathlib import Path

from flopwise.config import build_config
from flopwise.data.datadir import DataDir
from flopwise.train.trainer import train

README = Path(__file__).resolve().parents[2] / "README.md"


def _snippet(name: str) -> str:
    text = README.read_text()
    m = re.search(rf"<!-- snippet: {name} -->\s*```python\n(.*?)```", text, flags=re.S)
    assert m, f"README has no python block after <!-- snippet: {name} -->"
    return m.group(1)


def test_own_data_snippet_builds_a_data_directory_that_trains(tmp_path, monkeypatch):
    texts = tmp_path / "my_texts"
    texts.mkdir()
    for i in range(40):
        (texts / f"doc{i:02d}.txt").write_text(
            f"Document {i}. " + " ".join(f"the quick brown fox {j} jumps over the lazy dog" for j in range(30))
        )
    monkeypatch.chdir(tmp_path)
    exec(compile(_snippet("own-data").replace("vocab_size=8192", "vocab_size=400"), "README", "exec"), {})

    dd = DataDir(tmp_path / "my_data", verify=True)
    assert dd.vocab_size <= 400 and dd.num_tokens("train") > dd.num_tokens("val") > 0
    cfg = build_config(overrides=[
        f"data.path={tmp_path / 'my_data'}", "model.vocab_size=400", "model.d_model=32", "model.n_layers=1",
        "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_hidden=64", "train.seq_len=32",
        "train.micro_batch_size=4", "train.global_batch_size=4", "train.max_steps=3", "eval.batches=1",
        "eval.sample_tokens=4", f"train.run_dir={tmp_path / 'run'}",
    ])
    result = train(cfg, log=lambda s: None)
    assert result.steps == 3 and (tmp_path / "run" / "checkpoints" / "step-0000003").is_dir()
