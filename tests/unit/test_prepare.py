"""flopwise prepare: routing, budgets, framing, determinism, atomicity, kills and failures, tokenizers."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from flopwise.config import build_config
from flopwise.data.datadir import DataDir
from flopwise.data.loader import fixed_windows, overlap_note
from flopwise.data.prepare import PrepareError, PrepareOptions, Router, SplitWriter, encode_documents, prepare
from flopwise.data.shards import read_shard
from flopwise.data.tokenizer import train_bpe

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def write_corpus(folder, n_docs=120, seed=0):
    """A .jsonl corpus of documents of varying length, deterministic."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "part-0.jsonl", "w") as f:
        for i in range(n_docs):
            words = rng.choice(WORDS, size=int(rng.integers(5, 80)))
            f.write(json.dumps({"id": i, "text": f"doc {i}: " + " ".join(words)}) + "\n")
    return folder


def opts(tmp_path, **kw):
    base = dict(source=str(tmp_path / "corpus"), out=str(tmp_path / "data"), vocab_size=300, workers=1,
                tokenizer_sample_mb=1.0)
    base.update(kw)
    return PrepareOptions(**base)


def quiet(_line):
    pass


# ---------------------------------------------------------------- routing

def test_router_meets_exact_budgets_and_keeps_shares_along_the_stream():
    r = Router({"val": 100, "test": 0, "train": 1000}, {"val": 100.0, "test": 0.0, "train": 1000.0})
    assert r.route(30) == ("val", 30)  # the first document always goes to validation
    seen = []
    while (routed := r.route(30)) is not None:
        seen.append(routed)
    assert r.tokens == {"val": 100, "test": 0, "train": 1000}
    assert r.cut_documents == 2  # one document cut in each split to land exactly on the budget
    # Validation is spread along the stream, not taken from its start only.
    val_positions = [i for i, (s, _) in enumerate(seen) if s == "val"]
    assert val_positions[0] < 15 and val_positions[-1] > 20


def test_router_unbounded_train_never_done():
    r = Router({"val": None, "test": 0, "train": None}, {"val": 0.01, "test": 0.0, "train": 0.99})
    splits = [r.route(10)[0] for _ in range(1000)]
    assert splits[0] == "val" and 5 <= splits.count("val") <= 15 and not r.done()


def test_router_fills_explicit_budgets_first_when_train_is_unbounded():
    o = PrepareOptions(source="x", out="y", vocab_size=300, val_tokens=50, test_tokens=20)
    r = Router(o.targets(), o.weights(), o.fill_first())
    splits = [r.route(10) for _ in range(20)]
    # val and test share the head of the stream in proportion to their budgets, then train takes the rest.
    assert [s for s, _ in splits[:7]].count("val") == 5 and [s for s, _ in splits[:7]].count("test") == 2
    assert all(s == "train" for s, _ in splits[7:]) and r.tokens["val"] == 50 and r.tokens["test"] == 20
    # Without explicit budgets validation is a share spread along the stream, nothing first.
    assert PrepareOptions(source="x", out="y", vocab_size=300).fill_first() == frozenset()
    assert PrepareOptions(source="x", out="y", vocab_size=300, train_tokens=100, val_tokens=5).fill_first() == frozenset()


def test_router_shares_a_lone_long_document_as_a_train_head_and_a_held_out_tail():
    r = Router({"val": None, "test": 0, "train": None}, {"val": 0.01, "test": 0.0, "train": 0.99}, piece_tokens=100)
    # one document, a book in a single .txt: validation owes 100 of it (1%), takes that as its tail
    assert r.route_document(10_050) == [("train", 0, 9_950), ("val", 9_950, 100)]
    assert [keep for _, _, keep in r.route_document(80)] == [80]  # short documents stay whole
    # A budget met inside a document: what is past it is routed nowhere.
    b = Router({"val": 150, "test": 0, "train": 200}, {"val": 150.0, "test": 0.0, "train": 200.0}, piece_tokens=100)
    parts = b.route_document(1_000)
    assert parts == [("train", 0, 200), ("val", 850, 150)] and b.done() and b.route_document(10) == []
    assert b.cut_documents == 1  # the head, cut at train's budget (validation's tail is what it owes)


def test_held_out_splits_take_whole_documents_of_every_length_and_tails_only_early():
    """A stream of mixed lengths: a held-out split takes a document whole once it has room
    for it (one share ahead of its share of the stream so far), so long documents are in
    validation as often as short ones; before that, a long document gives it a tail, never a
    stretch with training text of the same document on both sides."""
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.choice([40, 60, 90, 400, 5_000], size=3_000)]
    r = Router({"val": None, "test": 0, "train": None}, {"val": 0.02, "test": 0.0, "train": 0.98}, piece_tokens=1_000)
    routed = [r.route_document(n) for n in lengths]
    shared = [i for i, p in enumerate(routed) if len(p) > 1]
    assert all(routed[i][0][0] == "train" and routed[i][1][1] == routed[i][0][2] for i in shared)  # head, then tail
    assert shared and max(shared) < 200, shared  # tails only while the stream is short against a long document
    assert abs(r.tokens["val"] / sum(r.tokens.values()) - 0.02) < 0.002
    whole = [(p[0][0], n) for p, n in zip(routed, lengths) if len(p) == 1]
    long_share = {s: sum(n for t, n in whole if t == s and n == 5_000) / sum(n for t, n in whole if t == s)
                  for s in ("train", "val")}
    assert abs(long_share["val"] - long_share["train"]) < 0.1, long_share  # no bias against long documents
    # only long documents (books): tails of at least a piece at first, then whole books
    books = Router({"val": None, "test": 0, "train": None}, {"val": 0.02, "test": 0.0, "train": 0.98}, piece_tokens=100)
    parts = [books.route_document(3_000) for _ in range(200)]
    tails = [p[-1] for p in parts if len(p) == 2]
    assert tails and all(s == "val" and keep >= 100 and offset + keep == 3_000 for s, offset, keep in tails)
    assert [("val", 0, 3_000)] in parts  # once the stream is long enough, a whole book
    assert abs(books.tokens["val"] / sum(books.tokens.values()) - 0.02) < 3_000 / (200 * 3_000)  # within a book


def test_bos_and_eos_frame_every_document():
    tok = train_bpe(["hello world " * 20], 270)
    ids, lengths = encode_documents(tok, ["hello", "world hello"], bos=5, eos=0, dtype=np.dtype(np.uint16))
    assert lengths.sum() == len(ids)
    first = ids[: lengths[0]]
    assert first[0] == 5 and first[-1] == 0 and ids[-1] == 0 and ids[lengths[0]] == 5
    ids2, lengths2 = encode_documents(tok, ["hello"], bos=None, eos=0, dtype=np.dtype(np.uint16))
    assert ids2[-1] == 0 and lengths2[0] == lengths[0] - 1


# ---------------------------------------------------------------- end to end

def test_prepare_exact_budgets_and_meta(tmp_path):
    write_corpus(tmp_path / "corpus", n_docs=300)
    out = prepare(opts(tmp_path, train_tokens=3000, val_tokens=400, test_tokens=200), log=quiet)
    dd = DataDir(out, verify=True)
    assert dd.num_tokens("train") == 3000 and dd.num_tokens("val") == 400 and dd.num_tokens("test") == 200
    meta = dd.meta
    assert meta["vocab_size"] <= 300 and meta["dtype"] == "uint16" and meta["eos_id"] == 0
    assert meta["recipe"]["tokens_per_document"]["median"] > 0
    assert meta["source"].startswith("files:") and len(meta["fingerprint"]) == 64
    assert all(info["documents"] > 0 for info in meta["splits"].values())
    assert not list(tmp_path.glob(".data.partial*"))


def test_whole_source_with_default_validation_share(tmp_path):
    write_corpus(tmp_path / "corpus", n_docs=150)
    out = prepare(opts(tmp_path, val_fraction=0.05), log=quiet)
    meta = json.loads((out / "meta.json").read_text())
    total_docs = sum(s["documents"] for s in meta["splits"].values())
    assert total_docs == 150  # every document used once
    share = meta["splits"]["val"]["tokens"] / (meta["splits"]["val"]["tokens"] + meta["splits"]["train"]["tokens"])
    assert 0.02 < share < 0.1


def test_whole_source_meets_an_explicit_validation_budget(tmp_path):
    write_corpus(tmp_path / "corpus", n_docs=150)
    lines = []
    out = prepare(opts(tmp_path, val_tokens=600, test_tokens=300), log=lines.append)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["val"]["tokens"] == 600 and meta["splits"]["test"]["tokens"] == 300
    assert sum(s["documents"] for s in meta["splits"].values()) == 150  # the rest went to train
    assert not any("WARNING" in line for line in lines)


def _default_eval(out):
    """(the overlap note, the data directory) of the default run's validation on the data at
    ``out``: its windows as the trainer builds them (``train/setup.py``) and checks them
    (``train/describe.py``), so this fails if prepare's floor and the trainer drift apart."""
    cfg = build_config()  # `flopwise train` with no preset: the default run
    seq_len, dd = cfg.train.seq_len, DataDir(out)
    windows = fixed_windows(dd, "val", seq_len, cfg.eval.windows)
    return overlap_note(len(windows), seq_len, dd.num_tokens("val")), dd


def test_default_split_has_a_floor_so_the_default_eval_does_not_overlap(tmp_path):
    """A user's report: the default 0.5% of a 1.6M-token corpus gave 8,084 validation tokens,
    and every run on it said its validation windows overlap (each token scored ~2x)."""
    write_corpus(tmp_path / "corpus", n_docs=2_500)  # ~250K tokens: 0.5% is ~1,300, a tenth ~25K
    lines = []
    note, dd = _default_eval(prepare(opts(tmp_path), log=lines.append))
    assert note == ""
    from flopwise.data.prepare import default_val_floor

    floor = default_val_floor()
    val, train = dd.num_tokens("val"), dd.num_tokens("train")
    assert floor.tokens <= val < floor.tokens + 300, val  # the floor, within a document
    assert val < 0.1 * (val + train)
    assert all(info["continued_documents"] == 0 for info in dd.meta["splits"].values())  # whole documents
    record = dd.meta["recipe"]["val_floor"]
    assert record["applied"] and record["reached"] and record["tokens"] == floor.tokens
    assert dd.meta["recipe"]["val_fraction"] == 0.005
    said = [line for line in lines if "raised to the floor" in line]
    assert len(said) == 1 and f"{floor.windows:,} windows of {floor.seq_len:,}+1 tokens" in said[0]
    assert "--val-fraction 0.005 alone would give ~1," in said[0]
    # the same share given explicitly wins: no floor, and the default eval's windows overlap
    lines = []
    note, dd = _default_eval(prepare(opts(tmp_path, out=str(tmp_path / "explicit"), val_fraction=0.005),
                                     log=lines.append))
    assert "overlap" in note and dd.num_tokens("val") < 0.01 * dd.num_tokens("train")
    assert dd.meta["recipe"]["val_floor"] is None and not any("the floor" in line for line in lines)
    # and so does an explicit --val-tokens
    out = prepare(opts(tmp_path, out=str(tmp_path / "tokens"), val_tokens=1_000), log=quiet)
    dd = DataDir(out)
    assert dd.num_tokens("val") == 1_000 and dd.meta["recipe"]["val_floor"] is None


def test_a_source_too_small_to_spare_the_floor_gives_validation_a_tenth(tmp_path):
    write_corpus(tmp_path / "corpus", n_docs=300)  # ~30K tokens: the floor would be over half of it
    lines = []
    note, dd = _default_eval(prepare(opts(tmp_path), log=lines.append))
    val, train = dd.num_tokens("val"), dd.num_tokens("train")
    assert 0.09 < val / (val + train) <= 0.1 + 200 / (val + train), (val, train)  # a tenth, within a document
    from flopwise.data.prepare import default_val_floor
    assert "overlap" in note  # too small for the default eval, and a run on it says so
    record = dd.meta["recipe"]["val_floor"]
    assert record["applied"] and not record["reached"]
    assert any("short of the floor (it takes at most 10% of the tokens)" in line for line in lines)
    # with a train budget: at most a tenth of the three budgets together
    floor = default_val_floor().tokens

    def val_budget(**kw):
        return PrepareOptions(source="x", out="y", vocab_size=300, **kw).targets()["val"]

    assert val_budget(train_tokens=9_000) == 1_000 and val_budget(train_tokens=8_000, test_tokens=1_000) == 1_000
    assert val_budget(train_tokens=1_000_000) == floor  # 0.5% would be 5,000
    assert val_budget(train_tokens=10**9) == 5_000_000  # the share is past the floor
    assert val_budget(train_tokens=1_000_000, val_fraction=0.005) == 5_000  # explicit: no floor
    assert val_budget(train_tokens=1_000_000, val_tokens=300) == 300
    out = prepare(opts(tmp_path, out=str(tmp_path / "budget"), train_tokens=9_000), log=quiet)
    assert DataDir(out).num_tokens("val") == 1_000


def test_the_floor_is_in_the_fingerprint_only_where_it_can_change_the_output():
    from flopwise.data.prepare import fingerprint

    def fp(**kw):
        return fingerprint(PrepareOptions(source="x", out="y", vocab_size=300, **kw), {"files": []}, None)

    assert fp() != fp(val_fraction=0.005)  # the whole source: the floor may raise validation
    assert fp(train_tokens=10**6) != fp(train_tokens=10**6, val_fraction=0.005)  # it raises the budget
    assert fp(train_tokens=10**9) == fp(train_tokens=10**9, val_fraction=0.005)  # 0.5% is past the floor
    assert fp(val_tokens=500) == fp(val_tokens=500, val_fraction=0.005)  # --val-tokens: as before the floor


def test_router_floor_takes_a_tenth_of_the_head_until_it_holds_the_floor():
    """Without knowing the source's size, the floor is met as soon as a tenth of the stream holds
    it; validation then waits until its own share passes the floor."""
    from flopwise.data.prepare import ValFloor

    floor = ValFloor(tokens=1_000, windows=10, seq_len=99, preset="test")
    r = Router({"val": None, "test": 0, "train": None}, {"val": 0.005, "test": 0.0, "train": 0.995}, val_floor=floor)
    splits = [r.route(10)[0] for _ in range(30_000)]
    val_at = [i for i, s in enumerate(splits) if s == "val"]
    assert val_at[:100] == list(range(0, 1_000, 10))  # a tenth of the head: the floor by 10,000 tokens
    assert not [i for i in val_at if 1_000 < i < 20_000]  # then nothing until 0.5% of the stream passes it
    assert r.tokens["val"] == 1_500  # then 0.5%: the share
    plain = Router({"val": None, "test": 0, "train": None}, {"val": 0.005, "test": 0.0, "train": 0.995})
    assert [plain.route(10)[0] for _ in range(30_000)].count("val") == 150  # without a floor


def test_a_single_long_text_file_is_shared_between_splits(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "book.txt").write_text(" ".join(rng.choice(WORDS, size=40_000)))  # one document
    out = prepare(opts(tmp_path, val_fraction=0.01), log=quiet)
    meta = json.loads((out / "meta.json").read_text())
    val, train = meta["splits"]["val"]["tokens"], meta["splits"]["train"]["tokens"]
    assert val == 4096 and train > 10 * val  # validation's share (1%) is less than a piece: a piece, the tail
    # one document: counted once, where it starts (train), and as continued in validation
    assert meta["splits"]["train"]["documents"] == 1 and meta["splits"]["val"]["documents"] == 0
    assert meta["splits"]["val"]["continued_documents"] == 1 and meta["documents"] == 1


def test_output_does_not_depend_on_worker_count(tmp_path):
    write_corpus(tmp_path / "corpus", n_docs=200)
    a = prepare(opts(tmp_path, out=str(tmp_path / "a"), workers=1, batch_docs=16), log=quiet)
    b = prepare(opts(tmp_path, out=str(tmp_path / "b"), workers=2, batch_docs=16), log=quiet)
    for name in ("train-00000.bin", "val-00000.bin", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert json.loads((a / "meta.json").read_text())["fingerprint"] == json.loads((b / "meta.json").read_text())["fingerprint"]


def test_shards_roll_over_at_shard_tokens(tmp_path):
    write_corpus(tmp_path / "corpus", n_docs=200)
    out = prepare(opts(tmp_path, train_tokens=2500, shard_tokens=1000), log=quiet)
    dd = DataDir(out, verify=True)
    assert [p.name for p in dd.shard_paths("train")] == ["train-00000.bin", "train-00001.bin", "train-00002.bin"]
    assert dd.shard_token_counts("train") == [1000, 1000, 500]


def test_rerun_is_a_no_op_and_other_inputs_need_overwrite(tmp_path):
    write_corpus(tmp_path / "corpus")
    out = prepare(opts(tmp_path, train_tokens=1000), log=quiet)
    mtime = os.stat(out / "train-00000.bin").st_mtime_ns
    lines = []
    prepare(opts(tmp_path, train_tokens=1000, workers=2), log=lines.append)  # workers do not change the output
    assert any("nothing to do" in line for line in lines)
    assert os.stat(out / "train-00000.bin").st_mtime_ns == mtime
    with pytest.raises(PrepareError, match="--overwrite"):
        prepare(opts(tmp_path, train_tokens=2000), log=quiet)
    assert DataDir(out).num_tokens("train") == 1000  # untouched
    prepare(opts(tmp_path, train_tokens=2000, overwrite=True), log=quiet)
    assert DataDir(out).num_tokens("train") == 2000


def test_interrupted_prepare_leaves_nothing_that_looks_prepared(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus", n_docs=200)
    calls = {"n": 0}
    real_write = SplitWriter.write

    def failing_write(self, ids):
        calls["n"] += 1
        if calls["n"] == 20:
            raise KeyboardInterrupt  # Ctrl-C in the middle of writing
        return real_write(self, ids)

    monkeypatch.setattr(SplitWriter, "write", failing_write)
    with pytest.raises(KeyboardInterrupt):
        prepare(opts(tmp_path), log=quiet)
    assert not (tmp_path / "data").exists()
    assert not list(tmp_path.glob(".data.*"))
    monkeypatch.setattr(SplitWriter, "write", real_write)
    out = prepare(opts(tmp_path), log=quiet)  # a rerun starts over cleanly
    DataDir(out, verify=True)


def test_interrupted_replacement_keeps_the_old_data(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus", n_docs=200)
    out = prepare(opts(tmp_path, train_tokens=1000), log=quiet)
    before = (out / "train-00000.bin").read_bytes()
    monkeypatch.setattr(SplitWriter, "write", lambda self, ids: (_ for _ in ()).throw(RuntimeError("disk full")))
    with pytest.raises(RuntimeError, match="disk full"):
        prepare(opts(tmp_path, train_tokens=2000, overwrite=True), log=quiet)
    assert (out / "train-00000.bin").read_bytes() == before
    DataDir(out, verify=True)


def test_loaded_tokenizer_with_bos_and_a_large_vocabulary_uses_uint32(tmp_path):
    from tokenizers import AddedToken

    write_corpus(tmp_path / "corpus", n_docs=60)
    tok = train_bpe([" ".join(WORDS)] * 50, 300)
    tok.add_special_tokens([AddedToken("<|begin_of_text|>", special=True)])
    tok.add_tokens([f"extra{i}" for i in range(70_000)])  # pushes ids past 65,535
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    out = prepare(opts(tmp_path, vocab_size=0, tokenizer=str(path), train_tokens=500), log=quiet)
    dd = DataDir(out, verify=True)
    assert dd.meta["dtype"] == "uint32" and dd.vocab_size > 65_536
    bos = dd.meta["bos_id"]
    train = read_shard(dd.shard_paths("train")[0])
    assert bos is not None and train[0] == bos and read_shard(dd.shard_paths("val")[0])[0] == bos
    eos_positions = np.flatnonzero(np.asarray(train) == dd.eos_id)
    assert len(eos_positions) and all(train[p + 1] == bos for p in eos_positions if p + 1 < len(train))


def test_bad_input_is_named_before_any_work(tmp_path):
    write_corpus(tmp_path / "corpus")
    with pytest.raises(PrepareError, match="exactly one of --tokenizer"):
        prepare(opts(tmp_path, vocab_size=0), log=quiet)
    with pytest.raises(PrepareError, match="--tokenizer '.*nope.json': file does not exist"):
        prepare(opts(tmp_path, vocab_size=0, tokenizer=str(tmp_path / "nope.json")), log=quiet)
    with pytest.raises(PrepareError, match="--vocab-size must be >= 257"):
        prepare(opts(tmp_path, vocab_size=100), log=quiet)
    with pytest.raises(PrepareError, match="--val-fraction"):
        prepare(opts(tmp_path, val_fraction=1.5), log=quiet)
    assert not (tmp_path / "data").exists()


def test_every_missing_optional_package_is_named_before_anything_is_written(tmp_path):
    """Issue 19: pyarrow and zstandard made unimportable for real (a fresh interpreter whose
    first import finder refuses them); prepare names both, with the install command, and
    writes nothing (no --out, no lock, no partial directory)."""
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    (corpus / "b.parquet").write_bytes(b"PAR1 not read")
    (corpus / "c.jsonl.zst").write_bytes(b"not read either")
    code = f"""
import sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pyarrow", "zstandard", "datasets"):
            raise ModuleNotFoundError(name, name=name)
sys.meta_path.insert(0, Missing())
from flopwise.data.prepare import PrepareError, PrepareOptions, prepare
for source in ({str(corpus)!r}, "hf:roneneldan/TinyStories"):
    try:
        prepare(PrepareOptions(source=source, out={str(tmp_path / "data")!r}, vocab_size=300), log=print)
    except PrepareError as e:
        print("REFUSED", e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    refused = [line for line in r.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 2, r.stdout
    assert "needs the pyarrow package: pip install 'flopwise[data]'" in refused[0]
    assert "needs the zstandard package: pip install 'flopwise[data]'" in refused[0]
    assert "hf:roneneldan/TinyStories (a Hugging Face dataset) needs the datasets package" in refused[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_source_exhausted_before_budget_warns(tmp_path):
    write_corpus(tmp_path / "corpus", n_docs=20)
    lines = []
    out = prepare(opts(tmp_path, train_tokens=10**7), log=lines.append)
    assert any("ran out before the budget" in line for line in lines)
    assert DataDir(out).num_tokens("train") < 10**7


def _summary_docs(lines):
    """(documents in the 'done' line, {split: documents} from the per-split lines) of the printed summary."""
    import re

    done = next(line for line in lines if line.startswith("prepare: done"))
    total = int(re.search(r"· ([\d,]+) docs,", done).group(1).replace(",", ""))
    per = {m.group(1): int(m.group(2).replace(",", ""))
           for m in (re.match(r"\s+(\w+)\s+[\d,]+ tokens · \s*([\d,]+) documents", line) for line in lines) if m}
    return total, per


def test_document_counts_add_up_when_a_long_document_spans_two_splits(tmp_path):
    """Issue 19: the summary said 830 documents in all but 35 + 796 by split."""
    rng = np.random.default_rng(1)
    write_corpus(tmp_path / "corpus", n_docs=60)
    (tmp_path / "corpus" / "a-book.txt").write_text(" ".join(rng.choice(WORDS, size=30_000)))  # read first
    lines = []
    out = prepare(opts(tmp_path, val_fraction=0.02), log=lines.append)
    meta = json.loads((out / "meta.json").read_text())
    by_split = {s: info["documents"] for s, info in meta["splits"].items()}
    total, printed = _summary_docs(lines)
    assert printed == by_split and sum(by_split.values()) == total == 61  # the book once, the 60 records once
    # the book: its head in train (counted there), its tail continued in validation
    assert meta["documents"] == 61 and meta["splits"]["val"]["continued_documents"] == 1


def test_document_counts_add_up_when_the_budget_stops_mid_batch(tmp_path):
    write_corpus(tmp_path / "corpus", n_docs=300)
    lines = []
    out = prepare(opts(tmp_path, train_tokens=2000, val_tokens=300, batch_docs=1024), log=lines.append)
    meta = json.loads((out / "meta.json").read_text())
    by_split = {s: info["documents"] for s, info in meta["splits"].items()}
    total, printed = _summary_docs(lines)
    assert printed == by_split and total == sum(by_split.values()) < 300
    assert meta["documents"] == total


# ---------------------------------------------------------------- kills, failures, links

def test_a_prepare_killed_between_the_two_renames_of_a_replacement_is_undone_by_the_next(tmp_path):
    write_corpus(tmp_path / "corpus")
    out = prepare(opts(tmp_path, train_tokens=1000), log=quiet)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    os.rename(out, tmp_path / ".data.old")  # the old data set aside, the new not yet renamed in: kill -9 here
    lines = []
    prepare(opts(tmp_path, train_tokens=1000), log=lines.append)
    assert any("restored" in line for line in lines) and any("nothing to do" in line for line in lines)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # the old data, not a rebuild
    assert not (tmp_path / ".data.old").exists()


def test_a_failed_rename_into_place_puts_the_old_data_back(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus")
    out = prepare(opts(tmp_path, train_tokens=1000), log=quiet)
    before = (out / "train-00000.bin").read_bytes()
    real_rename = os.replace  # what fsio.replace_dir renames with

    def failing(src, dst):
        if str(src).endswith(".data.partial"):
            raise OSError(28, "No space left on device", str(dst))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(PrepareError, match=r"cannot write .*data: no space left on the device; the partial output "
                                           r"was removed and .*data was left as it was"):
        prepare(opts(tmp_path, train_tokens=2000, overwrite=True), log=quiet)
    monkeypatch.setattr(os, "replace", real_rename)
    assert (out / "train-00000.bin").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".data") and not p.name.endswith(".lock")] == []


def test_follow_links_does_not_change_the_fingerprint_of_a_folder_without_links(tmp_path):
    write_corpus(tmp_path / "corpus")
    out = prepare(opts(tmp_path, train_tokens=1000), log=quiet)
    lines = []
    prepare(opts(tmp_path, train_tokens=1000, follow_links=True), log=lines.append)
    assert any("nothing to do" in line for line in lines) and out.is_dir()


WORKER = """
import os, sys, time
from flopwise.data import prepare
prepare.PARENT_POLL_S = 0.05
prepare.die_with_parent(os.getppid(), prctl=False)
print("armed", flush=True)
time.sleep(600)
"""
PARENT = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
print(worker.pid, worker.stdout.readline().strip() or f"failed: exit {worker.wait()}", flush=True)
time.sleep(600)
"""


def test_a_worker_dies_with_its_parent_where_prctl_is_unavailable_too():
    """The portable fallback of die_with_parent: a watcher thread (prctl is tested end to end
    in tests/integration/test_data_trust.py)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, WORKER], stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        pid, state = parent.stdout.readline().split(maxsplit=1)
        worker = int(pid)
        assert state.strip() == "armed"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 60
        while _alive(worker):
            assert time.monotonic() < deadline, "the worker outlived its parent"
            time.sleep(0.02)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if worker is not None and _alive(worker):
            os.kill(worker, signal.SIGKILL)
        parent.stdout.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return False
    return raw[raw.rindex(")") + 2] not in "ZX"


def test_a_directory_of_the_piece_routing_recipe_is_named_for_what_it_holds(tmp_path):
    """Recipe 2 cut long documents into pieces that could alternate between splits. Such a
    directory still trains, but the start of a run warns that held-out loss reads low, and a
    prepare into it without --overwrite says which recipe made it."""
    from flopwise.data.meta import held_out_overlap_note

    write_corpus(tmp_path / "corpus", n_docs=120)
    out = prepare(opts(tmp_path), log=quiet)
    meta_path = out / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["recipe"]["version"] == 3 and held_out_overlap_note(meta) == ""
    meta["recipe"]["version"], meta["fingerprint"] = 2, "0" * 64  # as recipe 2 wrote it
    meta["splits"]["val"]["continued_documents"] = 7
    meta_path.write_text(json.dumps(meta))
    note = held_out_overlap_note(meta)
    assert note.startswith("val holds pieces of at least 7 documents that train also holds") and "--overwrite" in note
    assert held_out_overlap_note({"recipe": {"version": 1}, "splits": {"val": {"continued_documents": 3}}}) == ""
    with pytest.raises(PrepareError, match=r"prepared by recipe 2; this flopwise prepares recipe 3"):
        prepare(opts(tmp_path), log=quiet)


def test_an_output_inside_its_source_or_a_source_inside_its_output_is_refused(tmp_path):
    """'prepare SRC --out SRC/sub' was accepted, and every later 'prepare SRC' failed on the
    output's own meta.json."""
    from flopwise.data.prepare import PrepareError, PrepareOptions

    src = tmp_path / "texts"
    (src / "deep").mkdir(parents=True)
    (src / "a.txt").write_text("text\n")
    (tmp_path / "link").symlink_to(src)
    for source, out, phrase in ((src, src / "sub", "is inside the source"), (src, src, "is inside the source"),
                                (tmp_path / "link", src / "sub", "is inside the source"),
                                (src / "deep", src, "is inside --out")):
        with pytest.raises(PrepareError, match=phrase):
            PrepareOptions(source=str(source), out=str(out), vocab_size=300).validate()
    PrepareOptions(source=str(src), out=str(tmp_path / "data"), vocab_size=300).validate()  # beside it: fine


def test_an_output_name_the_filesystem_cannot_hold_with_its_partial_suffix_is_refused(tmp_path):
    from flopwise.data.prepare import PrepareError, PrepareOptions

    src = tmp_path / "texts"
    src.mkdir()
    for length, phrase in ((300, "300 bytes"), (250, "at most 246")):
        with pytest.raises(PrepareError, match=phrase):
            PrepareOptions(source=str(src), out=str(tmp_path / ("o" * length)), vocab_size=300).validate()
    PrepareOptions(source=str(src), out=str(tmp_path / ("o" * 246)), vocab_size=300).validate()
