"""DataDir validation, the random-window loader and the fixed validation windows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flopwise.data.datadir import DataDir, DataDirError
from flopwise.data.loader import RandomWindowLoader, fixed_windows
from flopwise.data.shards import HEADER_SIZE, shard_name, write_shard
from flopwise.data.tokenizer import EOS_TOKEN, eos_id, file_sha256, load_tokenizer, train_bpe

TEXTS = [f"def f{i}(x):\n    return x * {i} + {i * i}  # line {i}\n" for i in range(60)]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    tok = train_bpe(TEXTS, 300)
    p = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(p))
    return p


def make_datadir(root, tokenizer_file, splits: dict[str, list[np.ndarray]]):
    """A data directory with the given token arrays as shards."""
    root.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(tokenizer_file)
    (root / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    vocab = tok.get_vocab_size()
    meta_splits = {}
    for split, arrays in splits.items():
        names = []
        for i, arr in enumerate(arrays):
            names.append(shard_name(split, i))
            write_shard(root / names[-1], arr, vocab)
        meta_splits[split] = {"shards": names, "tokens": int(sum(len(a) for a in arrays)), "documents": 1}
    meta = {
        "format_version": 1,
        "source": "test",
        "tokenizer": "tokenizer.json",
        "tokenizer_sha256": file_sha256(root / "tokenizer.json"),
        "vocab_size": vocab,
        "dtype": "uint16",
        "eos_id": eos_id(tok),
        "splits": meta_splits,
        "fingerprint": "x",
        "created": "now",
    }
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def rand_tokens(seed, n, vocab):
    return np.random.default_rng(seed).integers(0, vocab, size=n)


@pytest.fixture
def dd(tmp_path, tokenizer_file):
    v = load_tokenizer(tokenizer_file).get_vocab_size()
    root = make_datadir(
        tmp_path / "data",
        tokenizer_file,
        {"train": [rand_tokens(1, 3000, v), rand_tokens(2, 500, v), rand_tokens(3, 10, v)],
         "val": [rand_tokens(4, 700, v)]},
    )
    return DataDir(root)


# ----------------------------------------------------------------- DataDir


def test_datadir_properties(dd, tokenizer_file):
    tok = load_tokenizer(tokenizer_file)
    assert dd.vocab_size == tok.get_vocab_size()
    assert dd.eos_id == tok.token_to_id(EOS_TOKEN)
    assert dd.num_tokens("train") == 3510 and dd.num_tokens("val") == 700
    assert [len(s) for s in dd.shards("train")] == [3000, 500, 10]
    assert dd.shards("train") is dd.shards("train")  # opened once
    assert dd.tokenizer.decode(dd.tokenizer.encode("def g(x): pass").ids) == "def g(x): pass"
    assert set(dd.splits) == {"train", "val"}


def _meta(root):
    return json.loads((root / "meta.json").read_text())


def _set_meta(root, meta):
    (root / "meta.json").write_text(json.dumps(meta))


def test_datadir_missing_dir(tmp_path):
    with pytest.raises(DataDirError, match="does not exist"):
        DataDir(tmp_path / "nowhere")


def test_datadir_missing_meta(dd):
    (dd.path / "meta.json").unlink()
    with pytest.raises(DataDirError, match=r"meta\.json.*missing"):
        DataDir(dd.path)


def test_datadir_missing_field(dd):
    meta = _meta(dd.path)
    del meta["eos_id"]
    _set_meta(dd.path, meta)
    with pytest.raises(DataDirError, match=r"meta\.json.*eos_id"):
        DataDir(dd.path)


def test_datadir_missing_tokenizer(dd):
    (dd.path / "tokenizer.json").unlink()
    with pytest.raises(DataDirError, match=r"tokenizer\.json.*missing"):
        DataDir(dd.path)


def test_datadir_tokenizer_replaced(dd):
    (dd.path / "tokenizer.json").write_text((dd.path / "tokenizer.json").read_text() + " ")
    with pytest.raises(DataDirError, match="tokenizer_sha256"):
        DataDir(dd.path)


def test_datadir_missing_shard(dd):
    (dd.path / "train-00001.bin").unlink()
    with pytest.raises(DataDirError, match=r"train-00001\.bin.*missing"):
        DataDir(dd.path)


def test_datadir_vocab_mismatch(dd):
    write_shard(dd.path / "val-00000.bin", rand_tokens(4, 700, 50), 60000)
    with pytest.raises(DataDirError, match=r"val-00000\.bin.*vocab_size 60000.*meta\.json vocab_size"):
        DataDir(dd.path)


def test_datadir_corrupt_shard(dd):
    p = dd.path / "val-00000.bin"
    p.write_bytes(p.read_bytes()[: HEADER_SIZE + 11])
    with pytest.raises(DataDirError, match=r"val-00000\.bin.*truncated"):
        DataDir(dd.path)


def test_datadir_token_count_mismatch(dd):
    meta = _meta(dd.path)
    meta["splits"]["val"]["tokens"] = 1
    _set_meta(dd.path, meta)
    with pytest.raises(DataDirError, match=r"splits\.val\.tokens"):
        DataDir(dd.path)


def test_datadir_split_absent(dd):
    with pytest.raises(DataDirError, match=r"split 'test'.*train, val"):
        dd.shards("test")
    with pytest.raises(DataDirError, match=r"split 'test'"):
        RandomWindowLoader(dd, "test", 8, 2, seed=0)


# ----------------------------------------------------------------- loader


def batches(loader, n):
    return [tuple(t.clone() for t in loader.next_batch()) for _ in range(n)]


def test_shapes_and_dtype(dd):
    x, y = next(iter(RandomWindowLoader(dd, "train", seq_len=16, batch_size=4, seed=0)))
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert x.device.type == "cpu"


def test_same_seed_same_batches(dd):
    a = batches(RandomWindowLoader(dd, "train", 16, 4, seed=7), 5)
    b = batches(RandomWindowLoader(dd, "train", 16, 4, seed=7), 5)
    c = batches(RandomWindowLoader(dd, "train", 16, 4, seed=8), 5)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))


def test_target_shift_and_contiguity(dd):
    seq = 16
    windows = [np.lib.stride_tricks.sliding_window_view(np.asarray(s), seq + 1) for s in dd.shards("train")
               if len(s) > seq]
    hits_per_shard = np.zeros(len(windows), dtype=int)
    loader = RandomWindowLoader(dd, "train", seq, 8, seed=3)
    for _ in range(20):
        x, y = loader.next_batch()
        assert torch.equal(y[:, :-1], x[:, 1:])
        rows = torch.cat([x, y[:, -1:]], dim=1).numpy()
        for row in rows:  # each row is a contiguous slice of one shard
            found = [k for k, w in enumerate(windows) if (w == row).all(axis=1).any()]
            assert found, "row is not a contiguous window of any shard"
            hits_per_shard[found[0]] += 1
    # shard choice is proportional to usable windows: 2984 vs 484 (the 10-token shard has none)
    assert hits_per_shard[0] > hits_per_shard[1] > 0


def test_state_dict_resume(dd):
    a = RandomWindowLoader(dd, "train", 16, 4, seed=11)
    batches(a, 3)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON round trip
    rest = batches(a, 4)
    b = RandomWindowLoader(dd, "train", 16, 4, seed=999)
    b.load_state_dict(state)
    assert b.batches == 3
    for (xa, ya), (xb, yb) in zip(rest, batches(b, 4)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert b.batches == 7
    with pytest.raises(ValueError, match="split"):
        RandomWindowLoader(dd, "val", 16, 4, seed=0).load_state_dict(state)


def test_too_small_split(dd):
    with pytest.raises(ValueError, match=r"'val'.*seq_len=700.*701 tokens"):
        RandomWindowLoader(dd, "val", seq_len=700, batch_size=2, seed=0)
    RandomWindowLoader(dd, "val", seq_len=699, batch_size=2, seed=0).next_batch()  # exactly one window
    with pytest.raises(ValueError, match="seq_len=700"):
        fixed_windows(dd, "val", 700, 4)


def test_fixed_windows(dd):
    a = fixed_windows(dd, "train", 16, 10)
    b = fixed_windows(dd, "train", 16, 10)
    assert a.shape == (10, 17) and a.dtype == torch.int64
    assert torch.equal(a, b)
    # spans both usable shards, windows do not overlap and come from the data
    flat = [np.asarray(s) for s in dd.shards("train")]
    locs = []
    for row in a.numpy():
        for k, s in enumerate(flat):
            w = np.lib.stride_tricks.sliding_window_view(s, 17) if len(s) >= 17 else np.empty((0, 17))
            idx = np.nonzero((w == row).all(axis=1))[0]
            if len(idx):
                locs.append((k, int(idx[0])))
                break
    assert len(locs) == 10
    assert {k for k, _ in locs} == {0, 1}
    starts0 = sorted(o for k, o in locs if k == 0)
    assert all(b_ - a_ >= 17 for a_, b_ in zip(starts0, starts0[1:]))
    # more windows than fit without overlap still works, deterministically
    assert torch.equal(fixed_windows(dd, "val", 16, 100), fixed_windows(dd, "val", 16, 100))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_batches(dd):
    x, y = RandomWindowLoader(dd, "train", 16, 4, seed=0, device="cuda").next_batch()
    xc, yc = RandomWindowLoader(dd, "train", 16, 4, seed=0).next_batch()
    assert x.is_cuda and torch.equal(x.cpu(), xc) and torch.equal(y.cpu(), yc)
