"""Golden losses: the first losses of a seeded tiny run are stored; a change that should not
touch numerics must reproduce them (relative 1e-6: exact on one machine, tolerant of another
CPU's kernels).

The run's data depends on nothing installed but flopwise and ``tokenizers``: the corpus
(tests/golden/corpus.jsonl, generated text) and the tokenizer (tests/golden/tokenizer.json,
a byte-level BPE of 512 tokens) are files shipped here, made by tests/golden/make_corpus.py;
the test prepares them with ``flopwise prepare``'s own pipeline into a temporary directory.
tiny_losses.json records the torch and tokenizers versions the numbers were recorded with
and a hash of the token ids of both splits. Where the installed ``tokenizers`` is another
version and encodes the corpus into other tokens, the test skips, naming both versions (the
losses of other tokens say nothing about the numerics); other tokens under the same version
mean the corpus, the tokenizer file or the prepare pipeline changed, and the test fails.

Re-record deliberately, and say why in the commit:

    FLOPWISE_UPDATE_GOLDEN=1 python -m pytest -q tests/integration/test_golden.py

(after ``python tests/golden/make_corpus.py`` where the corpus or tokenizer is to change).
"""

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch

from flopwise.config import build_config
from flopwise.data.prepare import PrepareError, PrepareOptions, prepare
from flopwise.data.shards import read_shard
from flopwise.train.trainer import train

HERE = Path(__file__).resolve().parents[1] / "golden"
GOLDEN = HERE / "tiny_losses.json"
CORPUS, TOKENIZER = HERE / "corpus.jsonl", HERE / "tokenizer.json"
UPDATE = os.environ.get("FLOPWISE_UPDATE_GOLDEN") == "1"
# Every setting the numbers depend on is here, none taken from a shared fixture. The random-
# window loader (the default when the goldens were first taken) is pinned so that they keep
# guarding the model, loss and optimizer numerics (the epoch loader's exactness is tested in
# tests/unit/test_loader.py).
OVERRIDES = [
    "model.vocab_size=512", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_hidden=192", "model.max_seq_len=64", "train.seq_len=64", "train.micro_batch_size=8",
    "train.global_batch_size=16", "optim.warmup_steps=5", "train.max_steps=12", "train.log_every=1",
    "eval.every=6", "eval.windows=16", "eval.sample_tokens=0", "data.loader=random", "tracking.tensorboard=false",
]


def tokens_sha256(data: Path) -> str:
    """Hash of every split's token ids, in shard order (not of the files: their header is flopwise's)."""
    meta = json.loads((data / "meta.json").read_text())
    h = hashlib.sha256()
    for split in sorted(meta["splits"]):
        h.update(split.encode())
        for name in meta["splits"][split]["shards"]:
            h.update(np.ascontiguousarray(read_shard(data / name), dtype="<u4").tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def golden_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("golden") / "data"
    try:
        return prepare(PrepareOptions(source=str(CORPUS), out=str(out), tokenizer=str(TOKENIZER), val_fraction=0.1,
                                      workers=1), log=lambda s: None)
    except PrepareError as e:  # a tokenizers release that cannot read the file another one wrote
        recorded = json.loads(GOLDEN.read_text())["recorded_with"]["tokenizers"]
        if not str(e).startswith("--tokenizer") or UPDATE or recorded == tokenizers.__version__:
            raise
        pytest.skip(f"tokenizers {tokenizers.__version__} cannot load tests/golden/tokenizer.json, written by "
                    f"tokenizers {recorded}: {e}")


def test_tiny_run_reproduces_the_golden_losses(golden_data, tmp_path):
    want = json.loads(GOLDEN.read_text())
    versions = {"torch": torch.__version__, "tokenizers": tokenizers.__version__}
    tokens = tokens_sha256(golden_data)
    if not UPDATE and tokens != want["tokens_sha256"]:
        recorded = want["recorded_with"]["tokenizers"]
        if recorded != tokenizers.__version__:
            pytest.skip(f"tokenizers {tokenizers.__version__} encodes tests/golden/corpus.jsonl into other tokens "
                        f"than tokenizers {recorded}, which recorded the golden losses: nothing to compare "
                        "(re-record with FLOPWISE_UPDATE_GOLDEN=1 to guard numerics on this version)")
        pytest.fail(f"the golden corpus's tokens changed under the same tokenizers {recorded}: "
                    "tests/golden/corpus.jsonl, tokenizer.json or the prepare pipeline changed")

    result = train(build_config(overrides=OVERRIDES + [f"data.path={golden_data}", f"train.run_dir={tmp_path / 'run'}"]),
                   log=lambda s: None)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    got = {"train": [r["loss"] for r in rows if r.get("loss") is not None],
           "val": [r["val_loss"] for r in rows if "val_loss" in r]}
    if UPDATE:
        GOLDEN.write_text(json.dumps({
            "recorded_with": versions, "data": "tests/golden/corpus.jsonl + tokenizer.json, val_fraction 0.1",
            "tokens_sha256": tokens, "overrides": " ".join(OVERRIDES), **got}, indent=2) + "\n")
        want = json.loads(GOLDEN.read_text())
    assert len(got["train"]) == 12 and len(got["val"]) == 3
    for split in ("train", "val"):
        off = [(i, g, w, abs(g - w) / abs(w)) for i, (g, w) in enumerate(zip(got[split], want[split]))
               if g != pytest.approx(w, rel=1e-6)]
        assert not off, (f"{split} losses moved at {len(off)} of {len(want[split])} points (torch "
                         f"{versions['torch']} here, {want['recorded_with']['torch']} recorded):\n"
                         + "\n".join(f"  #{i}: {g!r} vs {w!r} (rel {r:.1e})" for i, g, w, r in off))
