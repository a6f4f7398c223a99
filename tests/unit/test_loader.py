"""DataDir validation, the random-window loader and the fixed validation windows."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from flopwise.data.datadir import DataDir, DataDirError
from flopwise.data.loader import (
    EpochLoader,
    LoaderOptions,
    RandomWindowLoader,
    document_ids,
    fixed_windows,
    make_loader,
)
from flopwise.data.shards import HEADER_SIZE, shard_name, write_shard
from flopwise.data.tokenizer import EOS_TOKEN, eos_id, file_sha256, load_tokenizer, train_bpe

TEXTS = [f"def f{i}(x):\n    return x * {i} + {i * i}  # line {i}\n" for i in range(60)]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    tok = train_bpe(TEXTS, 300)
    p = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(p))
    return p


def make_datadir(root, tokenizer_file, splits: dict[str, list[np.ndarray]], vocab: int | None = None,
                 extra_meta: dict | None = None):
    """A data directory with the given token arrays as shards.

    ``vocab`` overrides the tokenizer's vocabulary size in meta.json and the shard headers
    (the loaders never load the tokenizer), so tests can use unique token ids as labels.
    """
    root.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(tokenizer_file)
    (root / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    vocab = vocab or tok.get_vocab_size()
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
        **(extra_meta or {}),
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
        RandomWindowLoader(dd, "test", LoaderOptions(8, 2, seed=0))


# ----------------------------------------------------------------- loader


def batches(loader, n):
    return [tuple(t.clone() for t in loader.next_batch()) for _ in range(n)]


def test_shapes_and_dtype(dd):
    x, y = next(iter(RandomWindowLoader(dd, "train", LoaderOptions(seq_len=16, batch_size=4, seed=0))))
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert x.device.type == "cpu"


def test_same_seed_same_batches(dd):
    a = batches(RandomWindowLoader(dd, "train", LoaderOptions(16, 4, seed=7)), 5)
    b = batches(RandomWindowLoader(dd, "train", LoaderOptions(16, 4, seed=7)), 5)
    c = batches(RandomWindowLoader(dd, "train", LoaderOptions(16, 4, seed=8)), 5)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))


def test_target_shift_and_contiguity(dd):
    seq = 16
    windows = [np.lib.stride_tricks.sliding_window_view(np.asarray(s), seq + 1) for s in dd.shards("train")
               if len(s) > seq]
    hits_per_shard = np.zeros(len(windows), dtype=int)
    loader = RandomWindowLoader(dd, "train", LoaderOptions(seq, 8, seed=3))
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
    a = RandomWindowLoader(dd, "train", LoaderOptions(16, 4, seed=11))
    batches(a, 3)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON round trip
    rest = batches(a, 4)
    b = RandomWindowLoader(dd, "train", LoaderOptions(16, 4, seed=999))
    b.load_state_dict(state)
    assert b.batches == 3
    for (xa, ya), (xb, yb) in zip(rest, batches(b, 4)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert b.batches == 7
    with pytest.raises(ValueError, match="split"):
        RandomWindowLoader(dd, "val", LoaderOptions(16, 4, seed=0)).load_state_dict(state)


def test_too_small_split(dd):
    with pytest.raises(ValueError, match=r"'val'.*seq_len=700.*701 tokens"):
        RandomWindowLoader(dd, "val", LoaderOptions(seq_len=700, batch_size=2, seed=0))
    RandomWindowLoader(dd, "val", LoaderOptions(seq_len=699, batch_size=2, seed=0)).next_batch()  # exactly one window
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
    x, y = RandomWindowLoader(dd, "train", LoaderOptions(16, 4, seed=0, device="cuda")).next_batch()
    xc, yc = RandomWindowLoader(dd, "train", LoaderOptions(16, 4, seed=0)).next_batch()
    assert x.is_cuda and torch.equal(x.cpu(), xc) and torch.equal(y.cpu(), yc)
    for mode in ("random", "epoch"):  # prefetch: side-stream copies, event waits
        ref = make_loader(mode, dd, "train", LoaderOptions(16, 4, seed=0, doc_boundaries=True))
        gpu = make_loader(mode, dd, "train",
                          LoaderOptions(16, 4, seed=0, device="cuda", doc_boundaries=True, prefetch=True))
        for _ in range(5):
            for a, b in zip(gpu.next_batch(), ref.next_batch()):
                assert a.is_cuda and torch.equal(a.cpu(), b)
        assert gpu.state_dict() == ref.state_dict()
        gpu.close()


# ----------------------------------------------------------------- golden random windows


def test_random_windows_golden(tmp_path, tokenizer_file):
    """The trainer's batches for mode "random" on rank 0 of 1 must not change: pinned values."""
    dd = DataDir(make_datadir(tmp_path / "g", tokenizer_file,
                              {"train": [np.arange(1000) % 251, (np.arange(400) * 7) % 251]}))
    for loader in (RandomWindowLoader(dd, "train", LoaderOptions(6, 3, seed=1234)),
                   RandomWindowLoader(dd, "train", LoaderOptions(6, 3, seed=1234, rank=0, world_size=4)),
                   make_loader("random", dd, "train", LoaderOptions(6, 3, seed=1234, prefetch=True))):
        x, y = loader.next_batch()
        assert x.tolist() == [[36, 43, 50, 57, 64, 71], [9, 10, 11, 12, 13, 14], [127, 134, 141, 148, 155, 162]]
        assert y[:, -1].tolist() == [78, 15, 169]
        x, y = loader.next_batch()
        assert x.tolist() == [[66, 67, 68, 69, 70, 71], [35, 36, 37, 38, 39, 40], [205, 206, 207, 208, 209, 210]]


def test_random_ranks_independent_and_state_per_rank(dd):
    r0 = batches(RandomWindowLoader(dd, "train", LoaderOptions(16, 4, seed=5, rank=0, world_size=2)), 3)
    r1 = batches(RandomWindowLoader(dd, "train", LoaderOptions(16, 4, seed=5, rank=1, world_size=2)), 3)
    assert not any(torch.equal(a[0], b[0]) for a, b in zip(r0, r1))
    a = RandomWindowLoader(dd, "train", LoaderOptions(16, 4, seed=5, rank=1, world_size=2))
    batches(a, 2)
    state = json.loads(json.dumps(a.state_dict()))
    b = RandomWindowLoader(dd, "train", LoaderOptions(16, 4, seed=5, rank=1, world_size=2))
    b.load_state_dict(state)
    for (xa, _), (xb, _) in zip(batches(a, 3), batches(b, 3)):
        assert torch.equal(xa, xb)
    with pytest.raises(ValueError, match=r"rank 1 of 2.*rank 0 of 2"):
        RandomWindowLoader(dd, "train", LoaderOptions(16, 4, seed=5, rank=0, world_size=2)).load_state_dict(state)
    with pytest.raises(ValueError, match=r"rank 1 of 2.*rank 1 of 3"):
        RandomWindowLoader(dd, "train", LoaderOptions(16, 4, seed=5, rank=1, world_size=3)).load_state_dict(state)
    with pytest.raises(ValueError, match="rank"):
        RandomWindowLoader(dd, "train", LoaderOptions(16, 4, seed=5, rank=2, world_size=2))


# ----------------------------------------------------------------- epoch loader

VOCAB = 1 << 16


@pytest.fixture
def labelled(tmp_path, tokenizer_file):
    """Shards whose tokens are unique ids (1..), so a row tells where it came from.

    seq_len 16: 62 + 20 + 1 + 0 = 83 samples; remainders 7 + 12 + 0 + 5 = 24 tokens.
    """
    sizes = [1000, 333, 17, 5]
    starts = np.cumsum([1] + sizes[:-1]) + 100 * np.arange(4)  # ids jump between shards
    shards = [np.arange(s, s + n) for s, n in zip(starts, sizes)]
    return DataDir(make_datadir(tmp_path / "lab", tokenizer_file, {"train": shards, "val": shards[:1]},
                                vocab=VOCAB)), shards


def rank_loaders(dd, world, batch, **kw):
    return [EpochLoader(dd, "train", LoaderOptions(16, batch, seed=3, rank=r, world_size=world, **kw))
            for r in range(world)]


def sample_key(x):
    """(first token of each row): unique per sample, since token ids are unique."""
    return x[:, 0].tolist()


def test_epoch_exactly_once_two_ranks(labelled):
    dd, shards = labelled
    loaders = rank_loaders(dd, 2, 4)
    L = loaders[0]
    assert L.num_samples == 83 and L.batches_per_epoch == 10 and L.dropped_samples_per_epoch == 3
    assert L.remainder_tokens == 24
    assert L.target_tokens_per_epoch == 80 * 16
    assert L.dropped_tokens_per_epoch == 1355 - 80 * 16
    valid_starts = {int(s[0]) + 16 * j for s in shards for j in range((len(s) - 1) // 16)}
    assert len(valid_starts) == 83
    seen_epochs = []
    for epoch in range(3):
        assert all(ld.epoch == epoch and ld.global_sample_position == 0 for ld in loaders)
        seen, targets = [], []
        for _ in range(L.batches_per_epoch):
            per_rank = [ld.next_batch() for ld in loaders]
            keys = [sample_key(x) for x, _ in per_rank]
            assert not set(keys[0]) & set(keys[1])  # ranks are disjoint
            for x, y in per_rank:
                assert x.shape == y.shape == (4, 16)
                rows = torch.cat([x, y[:, -1:]], dim=1)
                assert torch.equal(rows[:, 1:] - rows[:, :-1], torch.ones(4, 16, dtype=torch.int64))  # contiguous,
                seen += sample_key(x)  # so within one shard (ids jump between shards: see valid_starts)
                targets += y.flatten().tolist()
        assert len(seen) == len(set(seen)) == 80  # every used sample once
        assert set(seen) <= valid_starts
        assert len(targets) == len(set(targets))  # every target token at most once
        assert len(valid_starts - set(seen)) == 3
        seen_epochs.append(seen)
    assert seen_epochs[0] != seen_epochs[1]  # a new permutation each epoch
    assert loaders[0].epoch == 3 and loaders[0].state_dict() == loaders[1].state_dict()


def test_epoch_every_token_once_when_batches_divide(tmp_path, tokenizer_file):
    """No drop: the union over ranks of one epoch's targets is every token but each shard's first."""
    shards = [np.arange(1, 1 + 16 * 10 + 1), np.arange(500, 500 + 16 * 6 + 1)]  # 10 + 6 samples, no remainder
    dd = DataDir(make_datadir(tmp_path / "div", tokenizer_file, {"train": shards}, vocab=VOCAB))
    loaders = rank_loaders(dd, 2, 2)
    assert loaders[0].dropped_samples_per_epoch == 0 and loaders[0].remainder_tokens == 0
    assert loaders[0].dropped_tokens_per_epoch == 2  # each shard's first token is only an input
    targets = []
    for _ in range(loaders[0].batches_per_epoch):
        for ld in loaders:
            targets += ld.next_batch()[1].flatten().tolist()
    assert sorted(targets) == sorted(np.concatenate([s[1:] for s in shards]).tolist())


def test_epoch_unshuffled_order_and_drop(labelled):
    dd, shards = labelled
    L = EpochLoader(dd, "train", LoaderOptions(16, 8, seed=0, shuffle=False))
    firsts = []
    for _ in range(L.batches_per_epoch):
        firsts += sample_key(L.next_batch()[0])
    expected = sorted({int(s[0]) + 16 * j for s in shards for j in range((len(s) - 1) // 16)})
    assert firsts == expected[:80]  # storage order; the last 3 samples are dropped
    assert sample_key(L.next_batch()[0]) == expected[:8]  # next epoch starts over


def test_epoch_too_small(labelled):
    dd, _ = labelled
    with pytest.raises(DataDirError, match=r"83 packed samples.*16 x 6 rank\(s\) = 96"):
        EpochLoader(dd, "train", LoaderOptions(16, 16, seed=0, rank=0, world_size=6))
    with pytest.raises(DataDirError, match=r"'val'.* too small for seq_len=1000: a window needs 1001 tokens"):
        EpochLoader(dd, "val", LoaderOptions(1000, 1, seed=0))  # not one window: the same words as the random loader's


def snapshot(loader):
    return json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("prefetch", [False, True])
def test_epoch_resume_mid_epoch_mid_accumulation(labelled, prefetch):
    """accum = 3 micro-batches per step; stop after 4 micro-batches (inside step 2 and epoch 0),
    resume, and run across the epoch boundary (10 batches per epoch): identical batches."""
    dd, _ = labelled
    a = EpochLoader(dd, "train", LoaderOptions(16, 8, seed=9, prefetch=prefetch))
    batches(a, 4)
    state = snapshot(a)
    assert state["epoch"] == 0 and state["global_sample_position"] == 32 and state["batches"] == 4
    rest = batches(a, 12)
    assert a.epoch == 1
    b = EpochLoader(dd, "train", LoaderOptions(16, 8, seed=9, prefetch=prefetch))
    batches(b, 1)  # whatever it did before is replaced
    b.load_state_dict(state)
    assert b.batches == 4
    for (xa, ya), (xb, yb) in zip(rest, batches(b, 12)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert b.state_dict() == a.state_dict()


def test_epoch_resume_at_epoch_boundary(labelled):
    dd, _ = labelled
    a = EpochLoader(dd, "train", LoaderOptions(16, 8, seed=9))
    batches(a, 10)  # exactly one epoch
    state = snapshot(a)
    assert state["epoch"] == 1 and state["global_sample_position"] == 0
    b = EpochLoader(dd, "train", LoaderOptions(16, 8, seed=9))
    b.load_state_dict(state)
    for (xa, _), (xb, _) in zip(batches(a, 3), batches(b, 3)):
        assert torch.equal(xa, xb)


def test_epoch_resume_on_other_world_size(labelled):
    """The position is global: 2 ranks x 4 <-> 1 rank x 8 resume exactly."""
    dd, _ = labelled
    two = rank_loaders(dd, 2, 4)
    for _ in range(7):
        for ld in two:
            ld.next_batch()
    state = snapshot(two[1])
    assert state == snapshot(two[0])
    one = EpochLoader(dd, "train", LoaderOptions(16, 8, seed=3))
    one.load_state_dict(state)
    for _ in range(6):  # across the epoch boundary
        x1, y1 = one.next_batch()
        parts = [ld.next_batch() for ld in two]
        assert torch.equal(x1, torch.cat([p[0] for p in parts])) and torch.equal(y1, torch.cat([p[1] for p in parts]))
    back = rank_loaders(dd, 2, 4)
    for ld in back:
        ld.load_state_dict(snapshot(one))
    x1 = one.next_batch()[0]
    assert torch.equal(x1, torch.cat([ld.next_batch()[0] for ld in back]))


def test_epoch_resume_refusals(labelled):
    dd, _ = labelled
    a = rank_loaders(dd, 2, 4)[0]
    batches(a, 2)
    state = snapshot(a)
    with pytest.raises(ValueError, match=r"2 rank\(s\) x batch_size 4, 8 samples per optimizer step; .* "
                                         r"2 rank\(s\) x batch_size 8, 16 samples per step"):
        EpochLoader(dd, "train", LoaderOptions(16, 8, seed=3, rank=0, world_size=2)).load_state_dict(state)
    with pytest.raises(ValueError, match=r"seq_len 16 in the state, 8 here"):
        EpochLoader(dd, "train", LoaderOptions(8, 8, seed=3)).load_state_dict(state)
    with pytest.raises(ValueError, match=r"seed 3 in the state, 4 here"):
        EpochLoader(dd, "train", LoaderOptions(16, 8, seed=4)).load_state_dict(state)
    with pytest.raises(ValueError, match=r"shuffle"):
        EpochLoader(dd, "train", LoaderOptions(16, 8, seed=3, shuffle=False)).load_state_dict(state)
    with pytest.raises(ValueError, match=r"mode 'epoch'.*mode 'random'"):
        RandomWindowLoader(dd, "train", LoaderOptions(16, 8, seed=3)).load_state_dict(state)
    with pytest.raises(ValueError, match=r"mode 'random'.*mode 'epoch'"):
        random_state = RandomWindowLoader(dd, "train", LoaderOptions(16, 8, seed=3)).state_dict()
        EpochLoader(dd, "train", LoaderOptions(16, 8, seed=3)).load_state_dict(random_state)
    changed = dict(state, shard_tokens=[1000, 333, 17, 6])
    with pytest.raises(ValueError, match=r"data changed.*\[1000, 333, 17, 6\].*\[1000, 333, 17, 5\]"):
        EpochLoader(dd, "train", LoaderOptions(16, 8, seed=3)).load_state_dict(changed)


# ----------------------------------------------------------------- document boundaries


def test_document_ids_rule():
    E, S = 0, 1  # EOS, BOS
    x = torch.tensor([[5, 6, E, 7, 8, E, 9, 9],   # EOS: the next token starts a document
                      [E, S, 5, E, S, 6, 7, S],   # EOS BOS is one boundary; a lone BOS starts one
                      [S, 5, 6, 7, 8, 9, 5, E]])  # BOS at 0 and EOS at the end start nothing
    assert document_ids(x, E, S).tolist() == [[0, 0, 0, 1, 1, 1, 2, 2],
                                              [0, 1, 1, 1, 2, 2, 2, 3],
                                              [0, 0, 0, 0, 0, 0, 0, 0]]
    assert document_ids(x, E).tolist()[1] == [0, 1, 1, 1, 2, 2, 2, 2]  # without BOS only EOS counts


@pytest.mark.parametrize("mode", ["random", "epoch"])
@pytest.mark.parametrize("bos", [None, 1])
def test_doc_boundaries_in_batches(tmp_path, tokenizer_file, mode, bos):
    rng = np.random.default_rng(0)
    toks = rng.integers(2, 50, size=3000)
    toks[rng.random(3000) < 0.1] = 0  # EOS
    toks[rng.random(3000) < 0.05] = 1  # BOS (or an ordinary token when meta has no bos_id)
    dd = DataDir(make_datadir(tmp_path / "docs", tokenizer_file, {"train": [toks]},
                              extra_meta={"eos_id": 0, "bos_id": bos}))
    loader = make_loader(mode, dd, "train", LoaderOptions(32, 4, seed=1, doc_boundaries=True))
    plain = make_loader(mode, dd, "train", LoaderOptions(32, 4, seed=1))
    for _ in range(5):
        x, y, docs = loader.next_batch()
        x0, y0 = plain.next_batch()
        assert torch.equal(x, x0) and torch.equal(y, y0)  # the option changes nothing else
        assert docs.dtype == torch.int64 and docs.shape == x.shape
        for row, d in zip(x.tolist(), docs.tolist()):
            want, cur = [], 0
            for t, tok in enumerate(row):
                if t > 0 and (row[t - 1] == 0 or (bos is not None and tok == bos)):
                    cur += 1
                want.append(cur)
            assert d == want
        assert (docs.max(dim=1).values > 0).any()


# ----------------------------------------------------------------- factory and prefetch


def test_make_loader(dd):
    assert isinstance(make_loader("random", dd, "train", LoaderOptions(16, 2, seed=0)), RandomWindowLoader)
    e = make_loader("epoch", dd, "train", LoaderOptions(16, 2, seed=0, rank=1, world_size=2, doc_boundaries=True))
    assert isinstance(e, EpochLoader) and e.rank == 1 and e.world_size == 2 and len(e.next_batch()) == 3
    with pytest.raises(ValueError, match=r"unknown loader mode 'sequential'.*'random' or 'epoch'"):
        make_loader("sequential", dd, "train", LoaderOptions(16, 2, seed=0))


def test_random_loader_ignores_the_epoch_options(dd):
    """The trainer gives either loader the same options: ``shuffle`` and ``step_samples`` are
    the epoch loader's, and change nothing in the random loader's batches or state."""
    opts = LoaderOptions(16, 4, seed=7)
    plain = RandomWindowLoader(dd, "train", opts)
    other = RandomWindowLoader(dd, "train", dataclasses.replace(opts, shuffle=False, step_samples=8))
    assert other.opts.step_samples == 8
    same_batches(batches(other, 3), batches(plain, 3))
    assert other.state_dict() == plain.state_dict()


@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_prefetch_same_batches_and_state(dd, mode):
    a = make_loader(mode, dd, "train", LoaderOptions(16, 4, seed=2))
    b = make_loader(mode, dd, "train", LoaderOptions(16, 4, seed=2, prefetch=True))
    for k in range(6):
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert a.state_dict() == b.state_dict()  # the prefetched batch is not counted
    b.close()
    assert a.state_dict() == b.state_dict()
    assert torch.equal(a.next_batch()[0], b.next_batch()[0])  # usable after close
    b.close()


def same_batches(got, want):
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        assert len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b)), f"batch {k} differs"


@pytest.mark.parametrize("mode", ["random", "epoch"])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_prefetch_depth_same_batches_and_state(labelled, mode, depth):
    """Up to `depth` batches in flight (across epoch boundaries: 10 batches per epoch), yet the
    same batches, doc ids and state after every batch as without prefetch."""
    dd, _ = labelled
    ref = make_loader(mode, dd, "train", LoaderOptions(16, 8, seed=4, doc_boundaries=True))
    pre = make_loader(mode, dd, "train", LoaderOptions(16, 8, seed=4, doc_boundaries=True, prefetch=depth))
    assert pre.prefetch == depth
    for k in range(25):
        same_batches(batches(pre, 1), batches(ref, 1))
        assert len(pre._pending) == depth  # really `depth` ahead, and none of them counted:
        assert snapshot(pre) == snapshot(ref), k
    if mode == "epoch":
        assert pre.epoch == ref.epoch == 2 and pre.global_sample_position == ref.global_sample_position
    pre.close()


@pytest.mark.parametrize("mode", ["random", "epoch"])
@pytest.mark.parametrize("depth", [1, 3])
def test_prefetch_state_mid_stream_resumes_exactly(labelled, mode, depth):
    """A state taken with batches in flight resumes, with prefetch off or 3 deep, on exactly the
    batches the uninterrupted loader goes on to draw."""
    dd, _ = labelled
    a = make_loader(mode, dd, "train", LoaderOptions(16, 8, seed=6, prefetch=depth))
    ref = make_loader(mode, dd, "train", LoaderOptions(16, 8, seed=6))
    batches(a, 7)
    batches(ref, 7)
    assert len(a._pending) == depth
    state = snapshot(a)
    assert state == snapshot(ref) and state["batches"] == 7
    rest = batches(a, 15)  # across the epoch boundary
    for resume_depth in (0, 3):
        b = make_loader(mode, dd, "train", LoaderOptions(16, 8, seed=6, prefetch=resume_depth))
        batches(b, 2)  # batches (and prefetched ones) of its own, which the state replaces
        b.load_state_dict(state)
        assert snapshot(b) == state
        same_batches(batches(b, 15), rest)
        assert snapshot(b) == snapshot(a)
        b.close()
    a.close()


@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_prefetch_close_then_continue(labelled, mode):
    """close() drops every batch in flight and restores the position as of those handed out:
    the next batches are the ones an uninterrupted loader draws, again and again."""
    dd, _ = labelled
    ref = make_loader(mode, dd, "train", LoaderOptions(16, 8, seed=8))
    pre = make_loader(mode, dd, "train", LoaderOptions(16, 8, seed=8, prefetch=4))
    pre.close()  # nothing in flight yet: harmless
    for n in (3, 1, 9):  # 13 batches: across the epoch boundary
        same_batches(batches(pre, n), batches(ref, n))
        assert len(pre._pending) == 4
        pre.close()
        assert not pre._pending and pre._executor is None
        assert snapshot(pre) == snapshot(ref)
    same_batches(batches(pre, 5), batches(ref, 5))
    pre.close()
    pre.close()


def test_prefetch_flag_values_and_pin_memory_on_cpu(dd):
    ref = batches(make_loader("random", dd, "train", LoaderOptions(16, 4, seed=3)), 4)
    assert make_loader("epoch", dd, "train", LoaderOptions(16, 4, seed=3, prefetch=True)).prefetch == 1
    assert make_loader("epoch", dd, "train", LoaderOptions(16, 4, seed=3, prefetch=False)).prefetch == 0
    assert make_loader("epoch", dd, "train", LoaderOptions(16, 4, seed=3)).prefetch == 0  # off by default
    for kw in (dict(prefetch=True), dict(pin_memory=False), dict(prefetch=2, pin_memory=False)):
        loader = make_loader("random", dd, "train", LoaderOptions(16, 4, seed=3, **kw))
        got = batches(loader, 4)
        same_batches(got, ref)
        assert not got[0][0].is_pinned()  # on a CPU nothing is pinned either way
        loader.close()
    with pytest.raises(ValueError, match=r"prefetch must be >= 0.*got -1"):
        make_loader("epoch", dd, "train", LoaderOptions(16, 4, seed=3, prefetch=-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("pin", [True, False])
def test_cuda_prefetch_depth_and_pinning(labelled, pin):
    dd, _ = labelled
    for mode in ("random", "epoch"):
        ref = make_loader(mode, dd, "train", LoaderOptions(16, 8, seed=5, doc_boundaries=True))
        opts = LoaderOptions(16, 8, seed=5, device="cuda", doc_boundaries=True, prefetch=3, pin_memory=pin)
        gpu = make_loader(mode, dd, "train", opts)
        for k in range(14):
            if k == 6:
                gpu.close()  # drops 3 in-flight copies; the next batches are unchanged
            for a, b in zip(gpu.next_batch(), ref.next_batch()):
                assert a.is_cuda and torch.equal(a.cpu(), b)
            assert gpu.state_dict() == ref.state_dict()
            assert gpu._held and all(host[0].is_pinned() == pin for _, host in gpu._held)
        gpu.close()
        plain = make_loader(mode, dd, "train", LoaderOptions(16, 8, seed=5, device="cuda", pin_memory=pin))
        cpu = make_loader(mode, dd, "train", LoaderOptions(16, 8, seed=5))
        assert torch.equal(plain.next_batch()[0].cpu(), cpu.next_batch()[0])


def test_epoch_resume_at_another_world_size_with_the_same_step(labelled):
    """2 ranks x 4 x 2 micro-batches -> 1 rank x 4 x 4 micro-batches (16 samples per step either
    way): after the switch, each step takes the same samples as the 2-rank run would have,
    across the epoch boundary (83 samples: 5 steps per epoch, 3 dropped); other step sizes
    are refused."""
    dd, _ = labelled
    two = rank_loaders(dd, 2, 4, step_samples=16)
    assert two[0].batches_per_epoch == 10 and two[0].dropped_samples_per_epoch == 3
    for _ in range(3 * 2):  # three steps
        for ld in two:
            ld.next_batch()
    one = EpochLoader(dd, "train", LoaderOptions(16, 4, seed=3, step_samples=16))
    one.load_state_dict(snapshot(two[0]))
    for step in range(5):  # steps 4..8: epoch 0 ends after step 5
        got = sorted(k for _ in range(4) for k in sample_key(one.next_batch()[0]))
        want = sorted(k for _ in range(2) for ld in two for k in sample_key(ld.next_batch()[0]))
        assert got == want, step
    assert one.epoch == two[0].epoch == 1
    with pytest.raises(ValueError, match=r"16 samples per optimizer step; .* 8 samples per step"):
        EpochLoader(dd, "train", LoaderOptions(16, 4, seed=3, step_samples=8)).load_state_dict(snapshot(two[0]))
