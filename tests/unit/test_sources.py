"""Text sources of ``flopwise prepare``: builtin, local files and folders, hf datasets.

The hf path is exercised through datasets' own local builders (hf:json, hf:parquet,
hf:text with data_files): same code as a hub dataset, no network.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import sys

import pytest

from flopwise.data import sources
from flopwise.data.sources import Source, SourceError, open_source, split_text

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstd = pytest.importorskip("zstandard")


def write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def write_parquet(path, **columns):
    pq.write_table(pa.table(columns), path)
    return path


def docs(src: Source) -> list[str]:
    return list(src.documents())


# --------------------------------------------------------------------------- each kind

def test_txt_one_document_per_file(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes(b"hello\r\n\r\nworld\n")
    src = open_source(str(p))
    assert src.kind == "files"
    assert docs(src) == ["hello\r\n\r\nworld\n"]  # byte for byte
    assert "1 file," in src.description and str(p.resolve()) in src.description
    assert docs(src) == docs(src)  # a fresh pass every call


def test_txt_not_utf8_is_replaced(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes(b"caf\xe9 ok")
    assert docs(open_source(str(p))) == ["caf\ufffd ok"]


def test_empty_documents_are_skipped(tmp_path):
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("b")
    write_jsonl(tmp_path / "c.jsonl", [{"text": ""}, {"text": "c"}])
    assert docs(open_source(str(tmp_path))) == ["b", "c"]


def test_jsonl_text_field_and_blank_lines(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "one", "body": "x"}\n\n   \n{"text": "two", "body": "y"}\n')
    assert docs(open_source(str(p))) == ["one", "two"]
    assert docs(open_source(str(p), text_field="body")) == ["x", "y"]


def test_json_array_and_json_lines_in_json(tmp_path):
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([{"text": "a"}, {"text": "b, [\"]"}, {"text": "c"}], indent=2))
    assert docs(open_source(str(arr))) == ["a", 'b, ["]', "c"]
    empty = tmp_path / "empty.json"
    empty.write_text(" [ ] \n")
    assert docs(open_source(str(empty))) == []
    lines = tmp_path / "lines.json"
    write_jsonl(lines, [{"text": "x"}, {"text": "y"}])
    assert docs(open_source(str(lines))) == ["x", "y"]


def test_json_array_streams_across_reads(tmp_path, monkeypatch):
    """Elements larger than a read, and split at every possible point, decode the same."""
    monkeypatch.setattr(sources, "READ_CHARS", 7)
    recs = [{"text": "t%d " % i * (i % 5), "n": 12345678901234 + i, "ok": True, "z": None} for i in range(40)]
    p = tmp_path / "a.json"
    p.write_text("[\n" + ",\n".join(json.dumps(r) for r in recs) + "\n]\n")
    assert docs(open_source(str(p))) == [r["text"] for r in recs if r["text"]]
    lines = [line for line, _ in sources.iter_json_array(sources._File("a.json", p, 0, 0, "json", ""))]
    assert lines == list(range(2, 42))


def test_parquet(tmp_path):
    p = write_parquet(tmp_path / "a.parquet", text=["p", "q", "r"], body=["1", "2", "3"], n=[1, 2, 3])
    assert docs(open_source(str(p))) == ["p", "q", "r"]
    assert docs(open_source(str(p), text_field="body")) == ["1", "2", "3"]


def test_parquet_many_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "PARQUET_BATCH_ROWS", 3)
    texts = [f"doc {i}" for i in range(10)]
    p = write_parquet(tmp_path / "a.parquet", text=texts)
    assert docs(open_source(str(p))) == texts


def test_jsonl_gz_and_txt_zst(tmp_path):
    gz = write_jsonl(tmp_path / "a.jsonl.gz", [{"text": "g1"}, {"text": "g2"}], opener=gzip.open)
    assert docs(open_source(str(gz))) == ["g1", "g2"]
    zs = tmp_path / "b.txt.zst"
    c = zstd.ZstdCompressor()
    zs.write_bytes(c.compress("zstd ".encode()) + c.compress("text\n".encode()))  # two frames
    assert docs(open_source(str(zs))) == ["zstd text\n"]
    zjson = tmp_path / "c.json.zstd"
    zjson.write_bytes(c.compress(json.dumps([{"text": "arr"}]).encode()))
    assert docs(open_source(str(zjson))) == ["arr"]


def test_folder_mixed_nested_sorted_hidden_skipped(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "c").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "a.txt").write_text("A")
    write_jsonl(tmp_path / "b" / "x.jsonl", [{"text": "BX1"}, {"text": "BX2"}])
    write_parquet(tmp_path / "b" / "c" / "p.parquet", text=["BCP"])
    write_jsonl(tmp_path / "b" / "y.jsonl.gz", [{"text": "BY"}], opener=gzip.open)
    (tmp_path / "c.json").write_text('[{"text": "C"}]')
    (tmp_path / ".secret.txt").write_text("hidden file")
    (tmp_path / ".hidden" / "h.txt").write_text("hidden folder")
    (tmp_path / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")  # binary: skipped, named in a note
    src = open_source(str(tmp_path))
    # sorted by relative path: a.txt < b/c/p.parquet < b/x.jsonl < b/y.jsonl.gz < c.json
    assert docs(src) == ["A", "BCP", "BX1", "BX2", "BY", "C"]
    assert [f[0] for f in src.identity["files"]] == ["a.txt", "b/c/p.parquet", "b/x.jsonl", "b/y.jsonl.gz", "c.json"]
    assert "5 files" in src.description and "1 file(s) skipped" in src.description
    assert "logo.png (binary" in " ".join(src.notes)
    json.dumps(src.identity)  # JSON-able
    assert docs(open_source(str(tmp_path))) == docs(src)  # deterministic


def test_identity_changes_when_a_file_changes(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("one")
    before = open_source(str(tmp_path)).identity
    assert open_source(str(tmp_path)).identity == before
    p.write_text("two!")  # size
    after_size = open_source(str(tmp_path)).identity
    assert after_size != before
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))  # mtime only
    assert open_source(str(tmp_path)).identity != after_size
    assert open_source(str(tmp_path), text_field="body").identity != open_source(str(tmp_path)).identity


def test_split_text_large_txt():
    text = "".join(f"para {i} " * 3 + "\n\n" for i in range(100))
    chunks = [text[i:i + 13] for i in range(0, len(text), 13)]
    out = list(split_text(iter(chunks), soft=50, hard=200))
    assert len(out) > 5
    assert all(len(d) <= 200 for d in out)
    assert all(d.endswith("\n") and not d.startswith("\n") for d in out[:-1])
    assert "".join(out).replace("\n", "") == text.replace("\n", "")  # only the split blank lines go
    # no blank line: cut at a line break before hard, else hard
    assert list(split_text(iter(["aaaa\nbbbb\ncccc\n"]), soft=3, hard=8)) == ["aaaa\n", "bbbb\n", "cccc\n"]
    assert list(split_text(iter(["x" * 25]), soft=3, hard=10)) == ["x" * 10, "x" * 10, "x" * 5]
    # small text: one document, untouched
    assert list(split_text(iter(["a\n\n", "b"]), soft=50, hard=200)) == ["a\n\nb"]


def test_large_txt_file_split_into_documents(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "READ_CHARS", 64)
    monkeypatch.setattr(sources, "TXT_DOC_CHARS", 100)
    monkeypatch.setattr(sources, "TXT_MAX_DOC_CHARS", 400)
    p = tmp_path / "big.txt"
    p.write_text("".join(f"line {i}\n" + ("\n" if i % 4 == 3 else "") for i in range(200)))
    out = docs(open_source(str(p)))
    assert len(out) > 5 and all(len(d) <= 400 for d in out)
    assert "".join(out).replace("\n", "") == p.read_text().replace("\n", "")


# --------------------------------------------------------------------------- errors

def test_nonexistent_path(tmp_path):
    with pytest.raises(SourceError, match="is not builtin, an hf: dataset or an existing file/folder"):
        open_source(str(tmp_path / "nope"))


def test_empty_folder_and_no_recognised_file(tmp_path):
    with pytest.raises(SourceError, match=r"is empty; accepted extensions: \.txt"):
        open_source(str(tmp_path))
    (tmp_path / "notes.bin").write_bytes(b"\x00x")
    (tmp_path / ".hidden.txt").write_text("x")
    with pytest.raises(SourceError) as e:
        open_source(str(tmp_path))
    assert str(tmp_path) in str(e.value) and "no text file: notes.bin (binary" in str(e.value)
    assert ".parquet" in str(e.value)


def test_unrecognised_file_extension(tmp_path):
    p = tmp_path / "a.csv"
    p.write_bytes(b"x\xff")
    with pytest.raises(SourceError, match=r"a\.csv: not text \(not UTF-8 text: byte 0xff at offset 1\); "
                                          r"accepted: \.txt"):
        open_source(str(p))
    p.write_text("x")  # plain text under another extension is read as text
    assert list(open_source(str(p)).documents()) == ["x"]


def test_missing_field_first_record_is_eager(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"content": "x", "id": 1}])
    with pytest.raises(SourceError) as e:
        open_source(str(p))  # at open, before documents()
    msg = str(e.value)
    assert f"{p}:1: record has no field 'text' (fields: content, id)" in msg


def test_field_did_you_mean(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"texts": "x"}])
    with pytest.raises(SourceError, match="did you mean --text-field texts"):
        open_source(str(p))


def test_later_bad_record_names_file_and_line(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "ok"}\n\n{"text": 3}\n')
    src = open_source(str(p))
    it = src.documents()
    assert next(it) == "ok"
    with pytest.raises(SourceError, match=rf"{p}:3: field 'text' is a number \(3\), not a string"):
        next(it)


def test_later_record_missing_field_and_null(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(SourceError, match=rf"{p}:2: record has no field 'text' \(fields: body\)"):
        docs(open_source(str(p)))
    q = tmp_path / "b.jsonl"
    q.write_text('{"text": null}\n')
    with pytest.raises(SourceError, match=rf"{q}:1: field 'text' is null \(None\), not a string"):
        open_source(str(q))


def test_record_not_an_object(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('["a", "b"]\n')
    with pytest.raises(SourceError, match=rf"{p}:1: record is an array"):
        open_source(str(p))
    q = tmp_path / "b.json"
    q.write_text('[{"text": "a"},\n "b"]')
    with pytest.raises(SourceError, match=rf"{q}:2: element is a string \('b'\)"):
        docs(open_source(str(q)))


def test_invalid_json_names_line(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "ok"}\n{"text": "broken\n')
    with pytest.raises(SourceError, match=rf"{p}:2: invalid JSON: Unterminated string"):
        docs(open_source(str(p)))
    first = tmp_path / "first.jsonl"
    first.write_text("not json\n")
    with pytest.raises(SourceError, match=rf"{first}:1: invalid JSON"):
        open_source(str(first))  # eager
    pretty = tmp_path / "obj.json"
    pretty.write_text('{\n  "text": "a"\n}\n')
    with pytest.raises(SourceError, match="must hold JSON Lines or one top-level array"):
        open_source(str(pretty))


@pytest.mark.parametrize(
    "body, line, msg",
    [
        ('[{"text": "a"},\n{"text": "b"}', 2, "unterminated array"),
        ('[{"text": "a"}\n {"text": "b"}]', 2, "expected ',' or ']'"),
        ('[{"text": "a"},\n\n {"text": }]', 3, "Expecting value"),
        ('[{"text": "a"}] [', 1, "extra data after the top-level array"),
        ('[{"text": "a"},\n]', 2, "Expecting value"),
    ],
)
def test_invalid_json_array(tmp_path, monkeypatch, body, line, msg):
    monkeypatch.setattr(sources, "READ_CHARS", 5)
    p = tmp_path / "a.json"
    p.write_text(body)
    with pytest.raises(SourceError, match=rf"{p}:{line}: invalid JSON array: .*{msg}"):
        docs(open_source(str(p)))


def test_parquet_missing_column_wrong_type_null(tmp_path):
    p = write_parquet(tmp_path / "a.parquet", body=["x"], id=[1])
    with pytest.raises(SourceError, match=rf"{p}: no column 'text' \(fields: body, id\)"):
        open_source(str(p))
    with pytest.raises(SourceError, match=rf"{p}: column 'id' has type int64, not a string"):
        open_source(str(p), text_field="id")
    q = write_parquet(tmp_path / "b.parquet", text=["x", None])
    with pytest.raises(SourceError, match=rf"{q}: row 2: field 'text' is null"):
        docs(open_source(str(q)))
    bad = tmp_path / "c.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(SourceError, match=rf"{bad}: not a readable parquet file"):
        open_source(str(bad))


def test_bad_compressed_files(tmp_path):
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(b"not gzip data")
    with pytest.raises(SourceError, match=rf"{gz}: cannot decompress \(gzip\)"):
        open_source(str(gz))
    zs = tmp_path / "b.txt.zst"
    zs.write_bytes(b"not zstd data at all")
    with pytest.raises(SourceError, match=rf"{zs}: cannot decompress \(zstd\)"):
        open_source(str(zs))
    trunc = tmp_path / "c.jsonl.gz"
    trunc.write_bytes(gzip.compress(b'{"text": "a"}\n' * 1000)[:-30])
    with pytest.raises(SourceError, match=rf"{trunc}: cannot decompress \(gzip\)"):
        docs(open_source(str(trunc)))


def test_missing_optional_package(tmp_path, monkeypatch):
    zs = tmp_path / "b.txt.zst"
    zs.write_bytes(zstd.ZstdCompressor().compress(b"x"))
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard -> ImportError
    with pytest.raises(SourceError, match=r"needs the 'zstandard' package: pip install 'flopwise\[data\]'"):
        open_source(str(zs))
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(SourceError, match=r"needs the 'datasets' package"):
        open_source("hf:someone/some-dataset")


def test_bad_arguments():
    with pytest.raises(SourceError, match="expected hf:NAME"):
        open_source("hf:")
    with pytest.raises(SourceError, match="SOURCE is empty"):
        open_source("")


# --------------------------------------------------------------------------- builtin

def test_builtin_first_documents():
    src = open_source("builtin")
    assert src.kind == "builtin" and src.description.startswith("builtin:python-stdlib-")
    first = list(itertools.islice(src.documents(), 3))
    assert len(first) == 3 and all(isinstance(d, str) and d for d in first)
    assert first == list(itertools.islice(open_source("builtin").documents(), 3))
    assert src.identity["python"] == sys.version.split()[0] and src.identity["files"] > 100
    json.dumps(src.identity)


# --------------------------------------------------------------------------- hf (local builders)

datasets = pytest.importorskip("datasets")


def test_hf_json_data_files(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}", "n": i} for i in range(3)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i}", "n": i} for i in range(2)])
    src = open_source("hf:json", data_files=[str(a), str(b)])
    assert src.kind == "hf"
    assert docs(src) == ["a0", "a1", "a2", "b0", "b1"]
    assert docs(src) == docs(src)
    assert src.description == "hf:json split=train data_files=2"
    ident = src.identity
    json.dumps(ident)
    assert ident["name"] == "json" and ident["config"] is None and ident["split"] == "train"
    assert ident["data_files"][0][:2] == [str(a), a.stat().st_size]
    write_jsonl(a, [{"text": "changed", "n": 0}])
    assert open_source("hf:json", data_files=[str(a), str(b)]).identity != ident


def test_hf_shuffle_buffer_deterministic(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"text": f"d{i:03d}"} for i in range(200)])
    plain = docs(open_source("hf:json", data_files=[str(p)]))
    s0 = open_source("hf:json", data_files=[str(p)], shuffle_buffer=50, seed=0)
    once = docs(s0)
    assert docs(s0) == once  # a second pass repeats the order
    assert docs(open_source("hf:json", data_files=[str(p)], shuffle_buffer=50, seed=0)) == once
    assert sorted(once) == plain and once != plain  # shuffled, nothing lost
    assert docs(open_source("hf:json", data_files=[str(p)], shuffle_buffer=50, seed=1)) != once
    assert s0.identity["shuffle_buffer"] == 50 and s0.identity["seed"] == 0


def test_hf_parquet_and_text_field(tmp_path):
    p = write_parquet(tmp_path / "a.parquet", text=["p", "q"], body=["x", "y"])
    assert docs(open_source("hf:parquet", data_files=[str(p)])) == ["p", "q"]
    assert docs(open_source("hf:parquet", data_files=[str(p)], text_field="body")) == ["x", "y"]


def test_hf_errors(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"content": "x", "id": 1}])
    want = r"hf:json split=train: examples have no field 'text' \(fields: content, id\)"
    with pytest.raises(SourceError, match=want):
        open_source("hf:json", data_files=[str(p)])
    with pytest.raises(SourceError, match=r"hf:json split=validation: cannot load the dataset"):
        open_source("hf:json", data_files=[str(p)], split="validation", text_field="content")
    with pytest.raises(SourceError, match=r"cannot load the dataset: FileNotFoundError"):
        open_source("hf:json", data_files=[str(tmp_path / "missing.jsonl")])
    q = tmp_path / "b.jsonl"
    q.write_text('{"text": "ok"}\n{"text": 5}\n')
    src = open_source("hf:text", data_files=[str(q)])  # hf:text: one example per line
    assert docs(src) == ['{"text": "ok"}', '{"text": 5}']


def test_large_gzip_jsonl_is_streamed(tmp_path):
    """Opening and taking the first document of a ~20 MB (uncompressed) .jsonl.gz reads a
    few blocks, not the file: peak Python allocations stay far below its size."""
    import tracemalloc

    p = tmp_path / "big.jsonl.gz"
    line = (json.dumps({"text": "word " * 200}) + "\n").encode()
    with gzip.open(p, "wb", compresslevel=1) as f:
        f.write(line * (20_000_000 // len(line)))
    tracemalloc.start()
    try:
        src = open_source(str(p))
        first = next(src.documents())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert first == "word " * 200
    assert peak < 2_000_000


def test_links_leading_out_of_the_folder_are_not_followed_unless_asked(tmp_path):
    root, outside = tmp_path / "corpus", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (root / "a.txt").write_text("A")
    (root / "sub" / "b.txt").write_text("B")
    (outside / "secret.txt").write_text("SECRET")
    (root / "host.txt").symlink_to(outside / "secret.txt")  # a file link out (like /etc/hostname)
    (root / "ext").symlink_to(outside, target_is_directory=True)  # a folder link out
    (root / "up").symlink_to("..", target_is_directory=True)  # a link to the folder's parent
    (root / "alias.txt").symlink_to("sub/b.txt")  # links inside the folder are read
    (root / "same").symlink_to("sub", target_is_directory=True)
    src = open_source(str(root))
    assert docs(src) == ["A", "B", "B"]  # a.txt, alias.txt, b.txt once (sub and its link same are one folder)
    assert "3 link(s) leading out of the folder not followed" in src.description
    assert len(src.notes) == 1 and "--follow-links" in src.notes[0]
    for shown in ("ext -> ", "host.txt -> ", "up -> .."):
        assert shown in src.notes[0]
    assert "SECRET" in docs(open_source(str(root), follow_links=True))
    assert open_source(str(root / "host.txt")).identity["files"][0][0] == "host.txt"  # SOURCE itself: named, read


def test_a_folder_with_only_links_out_says_so(tmp_path):
    (tmp_path / "outside.txt").write_text("x")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "o.txt").symlink_to(tmp_path / "outside.txt")
    with pytest.raises(SourceError, match=r"is empty \(1 link\(s\) leading out of it not followed; --follow-links"):
        open_source(str(tmp_path / "corpus"))
