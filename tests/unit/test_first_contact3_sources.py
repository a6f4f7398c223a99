"""``flopwise prepare`` on a folder of a user's own text (issue 45, item 10): plain text without a
known extension (``.md``, a man page, a file with no extension, a gzipped man page) is taken by
its content; binary files and what is not a regular file are skipped and named with the
reason; a compressed source's size is said to be compressed."""

from __future__ import annotations

import gzip
import json
import os
import re

import pytest

from flopwise.cli import main as cli_main
from flopwise.data.sources import SourceError, open_source

MAN_PAGE = ".TH LS 1\n.SH NAME\nls \\- list directory contents\n.SH DESCRIPTION\nList information about the FILEs.\n"


def _user_folder(root):
    """A folder as a user has it: text under several names, and things that are not text."""
    root.mkdir()
    (root / "a.txt").write_text("plain text by its extension\n")
    (root / "README.md").write_text("# Notes\n\nmarkdown is text too: caf\u00e9\n")
    (root / "LICENSE").write_text("Permission is hereby granted, free of charge\n")
    (root / "man").mkdir()
    (root / "man" / "ls.1").write_text(MAN_PAGE)
    with gzip.open(root / "man" / "cp.1.gz", "wt") as f:
        f.write(MAN_PAGE.replace("LS", "CP").replace("ls", "cp"))
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (root / "latin1.dat").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e\n".encode("latin-1"))
    with gzip.open(root / "blob.gz", "wb") as f:
        f.write(b"\x00\x01\x02binary inside a gzip" * 10)
    os.mkfifo(root / "pipe")
    return root


def test_plain_text_is_taken_by_content_and_what_is_skipped_is_named(tmp_path):
    src = open_source(str(_user_folder(tmp_path / "mine")))
    taken = [f[0] for f in src.identity["files"]]
    assert taken == ["LICENSE", "README.md", "a.txt", "man/cp.1.gz", "man/ls.1"]
    docs = list(src.documents())
    assert "markdown is text too: caf\u00e9" in docs[1] and "cp \\- list" in docs[3] and docs[4] == MAN_PAGE
    notes = "\n".join(src.notes)
    for name in ("LICENSE", "README.md", "man/cp.1.gz", "man/ls.1"):
        assert name in notes
    skipped = next(n for n in src.notes if n.startswith("skipping"))
    assert "logo.png (binary: a NUL byte in its first" in skipped
    assert "latin1.dat (not UTF-8 text" in skipped
    assert "blob.gz (binary: a NUL byte" in skipped
    assert "pipe (not a regular file)" in skipped
    assert "4 file(s) skipped" in src.description


def test_a_long_skip_list_names_the_first_few_then_a_count(tmp_path):
    root = tmp_path / "mine"
    root.mkdir()
    (root / "a.txt").write_text("text")
    for i in range(15):
        (root / f"img{i:02d}.bin").write_bytes(b"\x00" * 16)
    skipped = next(n for n in open_source(str(root)).notes if n.startswith("skipping"))
    assert "img00.bin" in skipped and "img09.bin" in skipped and "img10.bin" not in skipped
    assert "15 in all" in skipped


def test_a_folder_of_only_binary_files_names_them_in_its_error(tmp_path):
    root = tmp_path / "mine"
    root.mkdir()
    (root / "logo.png").write_bytes(b"\x89PNG\x00\x00")
    with pytest.raises(SourceError) as e:
        open_source(str(root))
    assert "logo.png (binary: a NUL byte" in str(e.value) and str(root) in str(e.value)


def test_a_single_file_is_taken_by_content_or_refused_with_the_reason(tmp_path):
    page = tmp_path / "ls.1"
    page.write_text(MAN_PAGE)
    assert list(open_source(str(page)).documents()) == [MAN_PAGE]
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x00\x01" * 100)
    with pytest.raises(SourceError, match=r"model\.bin: not text \(binary: a NUL byte in its first"):
        open_source(str(binary))


def test_a_compressed_source_says_its_size_is_compressed(tmp_path):
    gz = tmp_path / "corpus.txt.gz"
    with gzip.open(gz, "wt") as f:
        f.write("the same line of text again and again\n" * 2000)
    assert f"1 file, {gz.stat().st_size} B compressed" in open_source(str(gz)).description
    (tmp_path / "b.txt").write_text("x" * 3000)
    desc = open_source(str(tmp_path)).description
    assert "2 files, " in desc and f"{gz.stat().st_size} B of it compressed" in desc


def test_prepare_names_the_skipped_files_and_reads_the_text_ones(tmp_path, capsys):
    """Through the real command: a folder of a user's own text, prepared."""
    root = _user_folder(tmp_path / "mine")
    for i in range(40):  # enough text for a tiny tokenizer and both splits
        (root / f"notes-{i:02d}").write_text(f"note {i}: " + "words of a plain text note without extension " * 20)
    out = tmp_path / "data"
    rc = cli_main(["prepare", str(root), "--vocab-size", "300", "--out", str(out), "--workers", "1"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "skipping 4 file(s) that are not text: blob.gz (binary: a NUL byte" in text
    assert "logo.png (binary" in text and "latin1.dat (not UTF-8 text" in text and "pipe (not a regular file)" in text
    assert "as plain text by their content" in text and "README.md" in text and "man/ls.1" in text
    assert "other file(s) skipped" not in text
    meta = json.loads((out / "meta.json").read_text())
    assert "4 file(s) skipped" in meta["source"]
    # the tokenizer's sample is counted in characters of text, not beside a compressed size as "MB"
    assert re.search(r"trained a byte-level BPE of vocab [\d,]+ on [\d.]+M characters of text", text), text
