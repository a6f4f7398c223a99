"""Text sources for ``flopwise prepare SOURCE``: where documents come from.

:func:`open_source` turns the SOURCE argument into a :class:`Source`, whose
:meth:`Source.documents` yields one string per document, streamed (bounded memory: no
file or dataset is ever loaded whole), in a deterministic order, and can be called
again for a fresh pass (``prepare`` reads the start of a source more than once).

SOURCE is one of:

- ``builtin``: the Python standard library's ``.py`` files (the embedded corpus of
  :mod:`flopwise.data.builtin`), one document per file, sorted by relative path.
- a file or a folder. Folders are walked recursively, files sorted by relative path
  (``/`` separators), hidden files and folders (names starting with ``.``) skipped.
  A file with none of the extensions below is read as ``.txt`` when its content is plain
  text (its first ``SNIFF_BYTES``, decompressed for ``.gz``/``.zst``, are UTF-8 without a
  NUL byte: a ``README.md``, a man page, a ``LICENSE``), and skipped otherwise; both are
  named in :attr:`Source.notes` (a binary file, text in another encoding, a pipe, each
  with the reason) and the skipped ones counted in the description, whose size is said to
  be compressed where it is. A file with a known text extension is checked by content too
  (:func:`_kind_of`): UTF-16 (a byte-order mark), a NUL byte or an archive's magic bytes skip
  it with the reason; gzip/zstd magic under an uncompressed name is read as such; a head that
  is not UTF-8 is read with replacement characters, and said. Symbolic
  links are followed only while they stay inside the folder (each folder read once);
  a link that leads out of it -- to ``/etc/hostname``, to ``..``, to a home directory --
  is not read unless ``follow_links=True`` (``--follow-links``): a folder of text is
  what the user pointed at, not whatever its links reach. Links not followed are
  counted in the description and listed in :attr:`Source.notes`. SOURCE itself may be
  a link (the user named it). Recognised files:

  - ``.txt``: the whole file is one document, except that a file over
    ``TXT_DOC_CHARS`` (1M characters) is split into several: a document ends at the
    first blank line after 1M characters, or, with no blank line before
    ``TXT_MAX_DOC_CHARS`` (4M), at the last line break before it (or hard at 4M
    characters when there is none). A multi-GB text dump thus becomes ~1 MB documents
    instead of one document that would have to sit in memory whole. The blank lines
    at a split point are dropped; everything else is kept byte for byte.
  - ``.jsonl`` / ``.ndjson``: JSON Lines, one object per line; the document is the
    record's ``text_field``. Blank lines are skipped.
  - ``.json``: either JSON Lines, or one top-level array of objects (told apart by
    the first non-blank character, ``[``). Arrays are parsed element by element with
    an incremental decoder, so a large array file is streamed too.
  - ``.parquet``: the ``text_field`` column, read in record batches of that column
    only (``pyarrow``).
  - ``.txt``, ``.jsonl``, ``.ndjson`` and ``.json`` may be compressed: ``.gz``
    (gzip, concatenated members allowed) or ``.zst`` / ``.zstd`` (``zstandard``,
    streaming, multi-frame allowed), e.g. ``data.jsonl.gz``, ``part-0.txt.zst``.

  Text is decoded as UTF-8, bytes that are not UTF-8 becoming U+FFFD instead of stopping
  the run (a leading UTF-8 byte-order mark is dropped); each file where that happened is
  named once it was read (:attr:`Source.read_notes`), with the count and the first one's
  byte offset.
- ``hf:NAME[:CONFIG]``: a Hugging Face dataset, loaded with
  ``datasets.load_dataset(NAME, CONFIG, split=, streaming=True, revision=,
  data_files=)`` and, with ``shuffle_buffer > 0``, shuffled with
  ``.shuffle(seed=, buffer_size=)`` (same seed, same order). Hub datasets
  (``hf:HuggingFaceFW/fineweb-edu:sample-10BT``, ``hf:cerebras/SlimPajama-627B``,
  ``hf:roneneldan/TinyStories``) and datasets' own builders on local files
  (``hf:json``, ``hf:parquet``, ``hf:text`` with ``data_files``) go through the same
  code; the latter need no network. The identity of a hub dataset cannot see upstream
  changes unless ``revision`` pins a commit.

Every document that is the empty string is skipped (it carries no text).

Errors: bad input raises :class:`SourceError` when the source is *opened*, before any
expensive work: every file is listed and checked (its first record parsed, a parquet
file's schema read, a compressed file's first block decompressed), a dataset's first
example is read. A bad record found later while streaming raises too. Messages name
the file and line (JSON: 1-based line of the record; parquet: 1-based row), the field
and the value at fault.
"""

from __future__ import annotations

import codecs
import difflib
import gzip
import hashlib
import importlib
import io
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Generator, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flopwise.errors import FlopwiseError

from . import builtin

SOURCES_VERSION = 1  # bump when the documents a given input yields change
TXT_DOC_CHARS = 1_000_000  # a .txt document ends at the first blank line after this many characters
TXT_MAX_DOC_CHARS = 4_000_000  # ... and at a line break (or hard) before this many
READ_CHARS = 1 << 20  # characters per read of text and JSON-array files
SNIFF_BYTES = 8192  # a file without a known extension is text when these first bytes are UTF-8 without NUL
SHOWN_NAMES = 10  # file names a note lists before it gives the count
PARQUET_BATCH_ROWS = 1024
INSTALL_HINT = "pip install 'flopwise[data]'"

_TEXT_FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json"}
_COMPRESSIONS = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}
ACCEPTED = ".txt, .jsonl, .ndjson, .json, .parquet (text formats also as .gz, .zst or .zstd)"


class SourceError(FlopwiseError, ValueError):
    """Bad ``flopwise prepare`` SOURCE: the message names the file (and line or row), the
    field and the value at fault."""


@dataclass
class Source:
    """An opened, checked source. ``documents()`` starts a fresh pass on every call."""

    kind: str  # "builtin" | "files" | "hf"
    description: str  # for people and meta.json
    identity: dict  # JSON-able identity of the inputs (part of the data fingerprint)
    _documents: Callable[[], Iterator[str]] = field(repr=False, compare=False)
    notes: list[str] = field(default_factory=list)  # for the user (e.g. links not followed)
    # for the user once the documents were read: what reading found (bytes that are not UTF-8)
    read_notes: Callable[[], list[str]] = field(default=lambda: [], repr=False, compare=False)

    def documents(self) -> Iterator[str]:
        """One string per document, in a deterministic order, streamed."""
        return self._documents()


def open_source(
    spec: str,
    *,
    text_field: str = "text",
    split: str = "train",
    shuffle_buffer: int = 0,
    seed: int = 0,
    data_files: list[str] | None = None,
    revision: str | None = None,
    follow_links: bool = False,
) -> Source:
    """Open and check SOURCE (see the module docstring); raises :class:`SourceError`."""
    if not isinstance(spec, str) or not spec:
        raise SourceError("SOURCE is empty: give 'builtin', hf:NAME[:CONFIG] or a file or folder")
    if not text_field:
        raise SourceError("text_field (--text-field) is empty")
    if shuffle_buffer < 0:
        raise SourceError(f"shuffle_buffer (--shuffle-buffer) must be >= 0, got {shuffle_buffer}")
    if spec == "builtin":
        return _open_builtin()
    if spec.startswith("hf:"):
        return _open_hf(spec, text_field, split, shuffle_buffer, seed, data_files, revision)
    path = Path(spec).expanduser()
    if not path.exists():
        raise SourceError(
            f"SOURCE {spec!r} is not builtin, an hf: dataset or an existing file/folder"
            + (" (it is a broken symbolic link)" if path.is_symlink() else "")
        )
    return _open_files(spec, path, text_field, follow_links)


# --------------------------------------------------------------------------- helpers

def _require(module: str, package: str, why: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise SourceError(f"{why} needs the '{package}' package: {INSTALL_HINT} (or pip install {package})") from None


def _human_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _short(v: Any, limit: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _fields_hint(fields: list[str], want: str) -> str:
    shown = ", ".join(fields[:20]) + (f", ... ({len(fields)} in all)" if len(fields) > 20 else "")
    hint = f"(fields: {shown or 'none'})"
    close = difflib.get_close_matches(want, fields, n=1)
    if close:
        hint += f"; did you mean --text-field {close[0]}?"
    elif fields:
        hint += "; choose one with --text-field"
    return hint


def _record_text(rec: Any, text_field: str, where: str, what: str = "record") -> str:
    """The text of one record (a dict from JSON or a dataset example), or a SourceError."""
    if not isinstance(rec, dict):
        raise SourceError(
            f"{where}: {what} is {_json_type(rec)} ({_short(rec)}), not an object with field {text_field!r}"
        )
    if text_field not in rec:
        hint = _fields_hint([str(k) for k in rec], text_field)
        raise SourceError(f"{where}: {what} has no field {text_field!r} {hint}")
    v = rec[text_field]
    if not isinstance(v, str):
        raise SourceError(f"{where}: field {text_field!r} is {_json_type(v)} ({_short(v)}), not a string")
    return v


# --------------------------------------------------------------------------- builtin

def _open_builtin() -> Source:
    files = builtin.list_stdlib_files()
    if not files:
        raise SourceError(f"builtin: no .py files found under {builtin.stdlib_root()}")
    version = sys.version.split()[0]
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        h.update(f"{f.rel}\0{f.size}\n".encode())
    nbytes = sum(f.size for f in files)
    identity = {
        "kind": "builtin",
        "recipe": SOURCES_VERSION,
        "python": version,
        "implementation": sys.implementation.name,
        "files": len(files),
        "bytes": nbytes,
        "files_digest": h.hexdigest(),  # every (relative path, size)
    }

    def documents() -> Iterator[str]:
        for f in files:
            text = builtin.read_text(f)
            if text:
                yield text

    return Source("builtin", f"builtin:python-stdlib-{version} ({len(files)} files, {_human_bytes(nbytes)})",
                  identity, documents)


# --------------------------------------------------------------------------- local files

@dataclass(frozen=True)
class _File:
    rel: str  # relative to the SOURCE folder, "/" separators (the file name for a single file)
    path: Path
    size: int
    mtime_ns: int
    fmt: str  # "txt" | "jsonl" | "json" | "parquet"
    comp: str  # "" | "gz" | "zst"
    # bytes read as U+FFFD (not UTF-8), by a pass over it: {"count": N, "offset": first, "byte": its value}
    replaced: dict = field(default_factory=dict, compare=False, repr=False)


def _classify(name: str) -> tuple[str, str] | None:
    """(format, compression) from a file name, or None when not recognised."""
    low = name.lower()
    comp = ""
    for ext, c in _COMPRESSIONS.items():
        if low.endswith(ext):
            comp, low = c, low[: -len(ext)]
            break
    if low.endswith(".parquet"):
        return ("parquet", "") if not comp else None
    for ext, fmt in _TEXT_FORMATS.items():
        if low.endswith(ext):
            return fmt, comp
    return None


def _stat_file(path: Path, rel: str, kind: tuple[str, str]) -> _File:
    try:
        st = path.stat()
    except OSError as e:
        raise SourceError(f"{path}: cannot read: {e.strerror or e}") from None
    return _File(rel, path, st.st_size, st.st_mtime_ns, kind[0], kind[1])


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _list_folder(root: Path, follow_links: bool = False) -> tuple[list[_File], list[str], list[tuple[str, str]],
                                                                   list[str]]:
    """Files to read under ``root`` (sorted by relative path), the ones skipped ("rel (why)"),
    the ones read by their content ((rel, why): as plain text with no known extension, why
    :data:`BY_CONTENT`, or in the compression their bytes say), and the links not followed
    because they lead out of ``root`` ("rel -> target")."""
    files: list[_File] = []
    skipped: list[str] = []
    by_content: list[tuple[str, str]] = []
    outside: list[str] = []
    seen_dirs: set[str] = set()
    root_real = os.path.realpath(root)

    def leads_out(p: str) -> bool:
        if follow_links or not os.path.islink(p):
            return False
        if _inside(os.path.realpath(p), root_real):
            return False
        try:
            target = os.readlink(p)
        except OSError:  # replaced while we looked: it still led out
            target = "?"
        outside.append(f"{Path(p).relative_to(root).as_posix()} -> {target}")
        return True

    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen_dirs:  # a symlink loop or a folder linked twice
            dirnames[:] = []
            continue
        seen_dirs.add(real)
        dirnames[:] = [d for d in sorted(dirnames) if not d.startswith(".") and not leads_out(os.path.join(dirpath, d))]
        for name in filenames:
            if name.startswith(".") or leads_out(os.path.join(dirpath, name)):
                continue
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            kind, why = _kind_of(p)
            if kind is None:
                skipped.append(f"{rel} ({why})")
                continue
            if why:
                by_content.append((rel, why))
            files.append(_stat_file(p, rel, kind))
    files.sort(key=lambda f: f.rel)
    return files, sorted(skipped), sorted(by_content), sorted(outside)


# Compressed data by its first bytes: gzip and zstd are read (as their extensions are); the
# others are named, for the user to decompress first.
_MAGIC = ((b"\x1f\x8b", "gz"), (b"\x28\xb5\x2f\xfd", "zst"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"),
          (b"PK\x03\x04", "zip"), (b"7z\xbc\xaf\x27\x1c", "7z"))
BY_CONTENT = "by content"  # _kind_of's word for plain text read although its name is not a known one


def _magic(path: Path) -> str:
    """The compression a file's first bytes say it is in ("" for none known)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError:
        return ""
    return next((name for magic, name in _MAGIC if head.startswith(magic)), "")


def _kind_of(path: Path) -> tuple[tuple[str, str] | None, str]:
    """(format, compression) of a file and, when it is not taken by its name alone, why: the
    reason it is skipped (kind None), :data:`BY_CONTENT` for plain text with another name (a
    ``.md`` file, a man page, a ``LICENSE``), or the compression its bytes say it is in although
    its name does not. Every text file is checked by content, whatever its name: its first
    ``SNIFF_BYTES`` (decompressed) must be UTF-8 without a NUL byte, so UTF-16 text, random
    bytes or an archive named ``.txt`` are skipped with the reason, not tokenized."""
    if not path.is_file():
        return None, "not a regular file"
    kind = _classify(path.name)
    if kind is not None and kind[0] == "parquet":
        return kind, ""  # a binary format: its schema is read when the source is opened
    fmt, comp = kind if kind is not None else ("txt", next(
        (c for ext, c in _COMPRESSIONS.items() if path.name.lower().endswith(ext)), ""))
    magic, found = _magic(path), ""
    if magic and magic != comp:
        if comp or magic not in ("gz", "zst"):
            named = f"named .{path.name.rsplit('.', 1)[-1]}" if "." in path.name else "with no extension"
            return None, (f"{magic}-compressed data {named}: decompress it first"
                          if magic not in ("gz", "zst") else f"{magic}-compressed data {named}")
        comp, found = magic, f"{'gzip' if magic == 'gz' else 'zstd'}-compressed by its first bytes"
    why = _not_text(path, comp)
    if kind is not None and why.startswith("cannot"):
        return (fmt, comp), found  # named as text: the source's check names the file that does not decompress
    if kind is not None and why.startswith("not UTF-8"):  # named as text: read, its undecodable bytes replaced
        replaced = f"{why}: its undecodable bytes become U+FFFD"
        return (fmt, comp), f"{found}; {replaced}" if found else replaced
    if why:
        return None, why
    return (fmt, comp), found or ("" if kind is not None else BY_CONTENT)


def _not_text(path: Path, comp: str) -> str:
    """Why the start of a file (decompressed) is not plain text, or "" when it is: UTF-8 without
    NUL bytes in its first ``SNIFF_BYTES``, as text editors and ``grep`` tell text from binary."""
    try:
        with _open_binary(_File(path.name, path, 0, 0, "txt", comp)) as raw:
            head = raw.read(SNIFF_BYTES)
    except Exception as e:  # noqa: BLE001 - any failure to read or decompress is the reason it is skipped
        how = f"cannot decompress ({'gzip' if comp == 'gz' else 'zstd'})" if comp else "cannot read"
        return f"{how}: {getattr(e, 'strerror', None) or e}"
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "UTF-16 text (its byte-order mark): convert it to UTF-8 first (iconv -f UTF-16 -t UTF-8)"
    if b"\0" in head:
        return f"binary: a NUL byte in its first {_human_bytes(SNIFF_BYTES)}"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at the end is fine
    except UnicodeDecodeError as e:
        return f"not UTF-8 text: byte 0x{head[e.start]:02x} at offset {e.start}"
    return ""


def _shown_names(names: list[str], limit: int = SHOWN_NAMES) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _size_text(files: list[_File]) -> str:
    """The files' size on disk, said to be compressed where it is (it is not the text's size)."""
    total = sum(f.size for f in files)
    packed = sum(f.size for f in files if f.comp)
    if not packed:
        return _human_bytes(total)
    if packed == total:
        return f"{_human_bytes(total)} compressed"
    return f"{_human_bytes(total)} on disk, {_human_bytes(packed)} of it compressed"


def _open_files(spec: str, path: Path, text_field: str, follow_links: bool = False) -> Source:
    skipped: list[str] = []
    by_content: list[tuple[str, str]] = []
    outside: list[str] = []
    if path.is_dir():
        files, skipped, by_content, outside = _list_folder(path, follow_links)
        if not files:
            what = "is empty" if not skipped else f"has no text file: {_shown_names(skipped)}"
            if outside:
                what += f" ({len(outside)} link(s) leading out of it not followed; --follow-links reads them)"
            raise SourceError(f"SOURCE folder {path} {what}; accepted extensions: {ACCEPTED}, or plain UTF-8 text")
    else:
        kind, why = _kind_of(path)
        if kind is None:
            raise SourceError(f"SOURCE file {path}: not text ({why}); accepted: {ACCEPTED}, or plain UTF-8 text")
        by_content = [(path.name, why)] if why else []
        files = [_stat_file(path, path.name, kind)]

    for f in files:  # before any expensive work: every file opens and its first record is good
        check = _file_documents(f, text_field, check_only=True)
        next(check, None)
        check.close()

    desc = f"files:{path.resolve()} ({len(files)} file{'s' if len(files) != 1 else ''}, {_size_text(files)}"
    extra = [f"{len(skipped)} file(s) skipped"] if skipped else []
    if outside:
        extra.append(f"{len(outside)} link(s) leading out of the folder not followed")
    desc += f"; {'; '.join(extra)})" if extra else ")"
    notes = []
    plain = [rel for rel, why in by_content if why == BY_CONTENT]
    packed = [f"{rel} ({why})" for rel, why in by_content if why != BY_CONTENT]
    if plain:
        notes.append(f"reading {len(plain)} file(s) without a known extension as plain text by their "
                     f"content (UTF-8, no NUL byte): {_shown_names(plain)}")
    if packed:
        notes.append(f"reading {len(packed)} file(s) as their content shows, not as their name says: "
                     f"{_shown_names(packed)}")
    if skipped:
        notes.append(f"skipping {len(skipped)} file(s) that are not text: {_shown_names(skipped)}")
    if outside:
        notes.append(f"not following {len(outside)} symbolic link(s) that lead out of {path}: "
                     f"{_shown_names(outside)} (--follow-links reads them)")
    identity = {
        "kind": "files",
        "recipe": SOURCES_VERSION,
        "text_field": text_field,
        "txt_doc_chars": [TXT_DOC_CHARS, TXT_MAX_DOC_CHARS],
        "files": [[f.rel, f.size, f.mtime_ns] for f in files],
    }

    def documents() -> Iterator[str]:
        for f in files:
            yield from _file_documents(f, text_field)

    return Source("files", desc, identity, documents, notes, read_notes=lambda: _replaced_note(files))


@contextmanager
def _open_binary(f: _File) -> Iterator[io.BufferedReader | gzip.GzipFile]:  # or a zstandard reader
    with ExitStack() as stack:
        fh = stack.enter_context(open(f.path, "rb"))
        if f.comp == "gz":
            yield stack.enter_context(gzip.GzipFile(fileobj=fh, mode="rb"))
        elif f.comp == "zst":
            zstd = _require("zstandard", "zstandard", f"{f.path}: reading .zst files")
            yield stack.enter_context(zstd.ZstdDecompressor().stream_reader(fh, read_across_frames=True, closefd=False))
        else:
            yield fh


class _Counted(io.BufferedIOBase):
    """A binary stream that counts the bytes it hands on, so that a byte the UTF-8 decoder cannot
    decode is placed in the file (:func:`_note_replaced`): the text reader decodes each block as
    soon as it has read it, so the decoder's input ends where this stream's count is."""

    _last = threading.local()  # the stream that handed on the latest block, in this thread

    def __init__(self, raw):
        super().__init__()
        self._inner, self.pos, self.count, self.first = raw, 0, 0, (-1, 0)

    @property
    def name(self) -> Any:  # the text reader's name is its stream's
        return getattr(self._inner, "name", "")

    def readable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        return self._handed(self._inner.read(-1 if n is None else n))

    def read1(self, n: int = -1) -> bytes:
        return self._handed(self._inner.read1(n) if hasattr(self._inner, "read1") else self._inner.read(n))

    def _handed(self, data: bytes) -> bytes:
        self.pos += len(data)
        _Counted._last.stream = self
        return data


def _note_replaced(e: UnicodeError) -> tuple[str, int]:
    """The text reader's decoding error handler: U+FFFD, as ``errors="replace"``, and the bytes
    counted, the first one's offset kept, for the file's note (:func:`_replaced_note`)."""
    if not isinstance(e, UnicodeDecodeError):
        raise e
    stream = getattr(_Counted._last, "stream", None)
    if stream is not None:
        stream.count += 1
        if stream.first[0] < 0:
            stream.first = (stream.pos - len(e.object) + e.start, e.object[e.start])
    return "\ufffd", e.end


codecs.register_error("flopwise-replace-noted", _note_replaced)


@contextmanager
def _open_text(f: _File, newline: str) -> Iterator[io.TextIOWrapper]:
    with _open_binary(f) as raw:
        counted = _Counted(raw)
        text = io.TextIOWrapper(counted, encoding="utf-8-sig", errors="flopwise-replace-noted", newline=newline)
        try:
            yield text
        finally:
            text.detach()  # the binary stream is closed by _open_binary
            if counted.count > f.replaced.get("count", 0):  # the pass that read the most of it
                f.replaced.update(count=counted.count, offset=counted.first[0], byte=counted.first[1])


def _replaced_note(files: list[_File]) -> list[str]:
    """The note, once the files were read, on those whose bytes that are not UTF-8 were read as
    U+FFFD: each with the count and the first one's byte offset (in the decompressed text where
    the file is compressed); [] when there are none."""
    shown = [f"{f.rel} ({f.replaced['count']:,} sequence(s), the first at byte {f.replaced['offset']:,}"
             f"{' of its decompressed text' if f.comp else ''}: 0x{f.replaced['byte']:02x})"
             for f in files if f.replaced.get("count")]
    if not shown:
        return []
    return [f"read {len(shown)} file(s) with bytes that are not UTF-8 as U+FFFD: {_shown_names(shown)}"]


def _read_errors(f: _File) -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (OSError, EOFError)
    if f.comp == "zst":
        errors += (_require("zstandard", "zstandard", f"{f.path}: reading .zst files").ZstdError,)
    return errors


def _file_documents(f: _File, text_field: str, check_only: bool = False) -> Generator[str, None, None]:
    """Documents of one file; decompression and I/O errors become SourceErrors naming it.
    ``check_only``: the caller stops after the first item (txt: the first block is read;
    parquet: only the schema)."""
    if f.fmt == "parquet":
        yield from _parquet_documents(f, text_field, check_only)
        return
    errors = _read_errors(f)
    try:
        if f.fmt == "txt":
            yield from _txt_documents(f, check_only)
        elif f.fmt == "jsonl":
            yield from _jsonl_documents(f, text_field)
        elif _json_is_array(f):
            yield from _json_array_documents(f, text_field)
        else:
            hint = " (a .json file must hold JSON Lines or one top-level array)"
            yield from _jsonl_documents(f, text_field, hint=hint)
    except SourceError:
        raise
    except errors as e:
        what = {"gz": "gzip", "zst": "zstd"}.get(f.comp)
        how = f"cannot decompress ({what})" if what and not isinstance(e, PermissionError) else "cannot read"
        raise SourceError(f"{f.path}: {how}: {getattr(e, 'strerror', None) or e}") from e


# .txt --------------------------------------------------------------------------

_BLANK_LINES = re.compile(r"\n(?:[^\S\n]*\n)+")


def _txt_documents(f: _File, check_only: bool = False) -> Iterator[str]:
    with _open_text(f, newline="") as t:
        if check_only:  # open, decompress and decode the first block (cheap on a large folder)
            yield t.read(65536)
            return
        yield from (d for d in split_text(iter(lambda: t.read(READ_CHARS), ""), TXT_DOC_CHARS, TXT_MAX_DOC_CHARS) if d)


def split_text(chunks: Iterator[str], soft: int = TXT_DOC_CHARS, hard: int = TXT_MAX_DOC_CHARS) -> Iterator[str]:
    """Join text chunks into documents: all of it when it has at most ``soft`` characters;
    else cut at the first blank line(s) after ``soft`` characters (the blank lines are
    dropped), or at the last line break before ``hard``, or hard at ``hard``."""
    buf = ""
    for chunk in chunks:
        buf += chunk
        while len(buf) > soft:
            m = _BLANK_LINES.search(buf, soft - 1, hard)
            if m and m.end() < len(buf):  # (a run of blank lines ending the buffer may go on)
                yield buf[: m.start() + 1]
                buf = buf[m.end():]
            elif len(buf) >= hard:
                cut = buf.rfind("\n", soft, hard)
                cut = cut + 1 if cut >= 0 else hard
                yield buf[:cut]
                buf = buf[cut:]
            else:
                break
    if buf:
        yield buf


# .jsonl / .json ------------------------------------------------------------------

def _jsonl_documents(f: _File, text_field: str, hint: str = "") -> Iterator[str]:
    decoder = json.JSONDecoder(strict=False)
    with _open_text(f, newline="\n") as t:
        for lineno, line in enumerate(t, 1):
            if not line.strip():
                continue
            try:
                rec = decoder.decode(line)
            except json.JSONDecodeError as e:
                raise SourceError(f"{f.path}:{lineno}: invalid JSON: {e.msg} (column {e.colno}){hint}") from None
            text = _record_text(rec, text_field, f"{f.path}:{lineno}")
            if text:
                yield text


def _json_is_array(f: _File) -> bool:
    with _open_text(f, newline="") as t:
        while True:
            chunk = t.read(65536)
            if not chunk:
                return False
            s = chunk.lstrip()
            if s:
                return s[0] == "["


_WS = re.compile(r"[ \t\n\r]*")


def _json_array_documents(f: _File, text_field: str) -> Iterator[str]:
    for lineno, rec in iter_json_array(f, text_field):
        text = _record_text(rec, text_field, f"{f.path}:{lineno}", what="element")
        if text:
            yield text


def iter_json_array(f: _File, text_field: str = "text") -> Iterator[tuple[int, Any]]:
    """(line, element) for each element of a file holding one top-level JSON array,
    decoded incrementally: memory holds one element and one read, not the file."""
    decoder = json.JSONDecoder(strict=False)
    name = f.path
    with _open_text(f, newline="") as t:
        buf, i, eof = "", 0, False
        line, counted = 1, 0  # line number of buf[counted]

        def line_at(pos: int) -> int:
            nonlocal line, counted
            line += buf.count("\n", counted, pos)
            counted = pos
            return line

        def fill(n: int = READ_CHARS) -> bool:
            nonlocal buf, i, counted, eof
            chunk = t.read(n)
            if not chunk:
                eof = True
                return False
            line_at(i)
            buf, counted, i = buf[i:] + chunk, 0, 0
            return True

        def skip_ws() -> bool:
            """Advance past whitespace; False at the end of the file."""
            nonlocal i
            while True:
                i = _WS.match(buf, i).end()  # type: ignore[union-attr]  # [ \t\n\r]* matches anywhere
                if i < len(buf):
                    return True
                if not fill():
                    return False

        def fail(pos: int, msg: str) -> SourceError:
            return SourceError(f"{name}:{line + buf.count(chr(10), counted, pos)}: invalid JSON array: {msg}")

        if not skip_ws() or buf[i] != "[":
            raise fail(i, "expected '[' at the start")
        i += 1
        if not skip_ws():
            raise fail(i, "unterminated array (no closing ']')")
        if buf[i] == "]":
            i += 1
        else:
            while True:
                while True:
                    try:
                        obj, end = decoder.raw_decode(buf, i)
                    except json.JSONDecodeError as e:
                        # near the end of what was read it may just be cut off: read more (doubling)
                        maybe_cut = e.pos >= len(buf) - 32 or e.msg.startswith("Unterminated string")
                        if not eof and maybe_cut and fill(max(READ_CHARS, len(buf) - i)):
                            continue
                        raise fail(e.pos, f"{e.msg}") from None
                    if end == len(buf) and not eof and fill():  # a number may go on in the next read
                        continue
                    break
                yield line_at(i), obj
                i = end
                if not skip_ws():
                    raise fail(i, "unterminated array (no closing ']')")
                c = buf[i]
                if c == "]":
                    i += 1
                    break
                if c != ",":
                    raise fail(i, f"expected ',' or ']' after an element, found {c!r}")
                i += 1
                if not skip_ws():
                    raise fail(i, "unterminated array (no closing ']')")
        if skip_ws():
            raise fail(i, f"extra data after the top-level array: {buf[i:i + 20]!r}")


# .parquet ------------------------------------------------------------------------

def _parquet_documents(f: _File, text_field: str, check_only: bool = False) -> Iterator[str]:
    _require("pyarrow", "pyarrow", f"{f.path}: reading .parquet files")
    import pyarrow as pa  # lazy: pyarrow is optional ([data]), parquet only
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f.path)
        schema = pf.schema_arrow
    except (OSError, pa.ArrowException) as e:
        raise SourceError(f"{f.path}: not a readable parquet file: {e}") from None
    if text_field not in schema.names:
        raise SourceError(f"{f.path}: no column {text_field!r} {_fields_hint(schema.names, text_field)}")
    typ = schema.field(text_field).type
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    string_types = [pa.types.is_string, pa.types.is_large_string, getattr(pa.types, "is_string_view", None)]
    if not any(is_t(typ) for is_t in string_types if is_t is not None):
        raise SourceError(f"{f.path}: column {text_field!r} has type {typ}, not a string")
    if check_only:
        return
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
            for v in batch.column(0).to_pylist():
                row += 1
                if v is None:
                    raise SourceError(f"{f.path}: row {row}: field {text_field!r} is null, not a string")
                if v:
                    yield v
    except (OSError, pa.ArrowException) as e:
        raise SourceError(f"{f.path}: cannot read after row {row}: {e}") from None


# --------------------------------------------------------------------------- Hugging Face

def _open_hf(spec: str, text_field: str, split: str, shuffle_buffer: int, seed: int,
             data_files: list[str] | None, revision: str | None) -> Source:
    name, _, config = spec[3:].partition(":")
    if not name:
        raise SourceError(f"SOURCE {spec!r}: expected hf:NAME[:CONFIG], e.g. hf:HuggingFaceFW/fineweb-edu:sample-10BT")
    datasets = _require("datasets", "datasets", f"SOURCE {spec!r} (a Hugging Face dataset)")
    data_files = list(data_files) if data_files else None
    where = f"{spec} split={split}"
    try:
        ds = datasets.load_dataset(name, config or None, split=split, streaming=True,
                                   revision=revision, data_files=data_files)
    except Exception as e:  # unknown name/config/split, no network, missing data files ...
        raise SourceError(f"{where}: cannot load the dataset: {type(e).__name__}: {e}") from e

    features = getattr(ds, "features", None)
    if features is not None and text_field not in features:
        raise SourceError(f"{where}: examples have no field {text_field!r} {_fields_hint(list(features), text_field)}")
    try:  # the first example, unshuffled (cheap: no buffer to fill)
        first = next(iter(ds), None)
    except Exception as e:
        raise SourceError(f"{where}: cannot read the first example: {type(e).__name__}: {e}") from e
    if first is None:
        raise SourceError(f"{where}: the split has no examples")
    _record_text(first, text_field, f"{where} example 0", what="example")

    if shuffle_buffer > 0:
        ds = ds.shuffle(seed=seed, buffer_size=shuffle_buffer)

    desc = f"hf:{name}" + (f":{config}" if config else "") + f" split={split}"
    if revision:
        desc += f" revision={revision}"
    if data_files:
        desc += f" data_files={len(data_files)}"
    if shuffle_buffer > 0:
        desc += f" shuffle_buffer={shuffle_buffer} seed={seed}"
    identity: dict[str, Any] = {
        "kind": "hf",
        "recipe": SOURCES_VERSION,
        "name": name,
        "config": config or None,
        "split": split,
        "revision": revision,
        "text_field": text_field,
        "data_files": [_data_file_identity(p) for p in data_files] if data_files else None,
        "shuffle_buffer": shuffle_buffer,
        "seed": seed if shuffle_buffer > 0 else None,
    }

    def documents() -> Iterator[str]:
        n = 0
        try:
            for n, ex in enumerate(ds):
                text = _record_text(ex, text_field, f"{where} example {n}", what="example")
                if text:
                    yield text
        except SourceError:
            raise
        except Exception as e:  # network drop, bad data file
            raise SourceError(f"{where}: reading after example {n}: {type(e).__name__}: {e}") from e

    return Source("hf", desc, identity, documents)


def _data_file_identity(p: str) -> Any:
    """A local data file's path with its size and mtime (so editing it changes the
    identity); any other entry (a URL, a glob, an hf:// path) as given."""
    try:
        st = os.stat(os.path.expanduser(p))
    except (OSError, ValueError):
        return p
    return [p, st.st_size, st.st_mtime_ns]
