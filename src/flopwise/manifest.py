"""Manifests: the size and CRC32 of each file of a directory, in one JSON file -- a checkpoint's
``COMPLETE`` and a run directory's ``manifest.json`` (config.yaml, plan.json, run.json).

Below ``checkpoints`` (which writes and reads checkpoints with torch) and free of torch itself,
so that what only checks a run's files -- ``flopwise report``, and the CLI that imports it for
every command -- starts without importing torch (about 2 s of CPU)."""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any, Callable

from flopwise.errors import FlopwiseError
from flopwise.fsio import FileFormatError, read_json, write_file, write_json

FORMAT_VERSION = 1
_CHUNK = 1 << 22


class CheckpointError(FlopwiseError, RuntimeError):
    """A checkpoint (or a run's file) that cannot be written or trusted; the message names the file."""


class _ChecksummedFile:
    """A write-only file object that keeps the CRC32 and size of what passes through."""

    def __init__(self, f):
        self._f = f
        self.crc = 0
        self.size = 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def write_checksummed(path: Path, writer: Callable[[Any], None]) -> dict[str, int]:
    """Write ``path`` through ``writer(file)``, fsynced; return its manifest entry (size, CRC32)."""
    with open(path, "wb") as raw:
        f = _ChecksummedFile(raw)
        writer(f)
        raw.flush()
        os.fsync(raw.fileno())
    return {"bytes": f.size, "crc32": f.crc & 0xFFFFFFFF}


def _file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc & 0xFFFFFFFF


def file_entry(path: Path) -> dict[str, int]:
    """A manifest entry (size, CRC32) for a file written by someone else (DCP's shards)."""
    return {"bytes": path.stat().st_size, "crc32": _file_crc(path)}


def data_entry(data: str | bytes) -> dict[str, int]:
    """The manifest entry (size, CRC32) of ``data`` as it will be written."""
    blob = data.encode("utf-8") if isinstance(data, str) else data
    return {"bytes": len(blob), "crc32": zlib.crc32(blob) & 0xFFFFFFFF}


def entry_problem(path: Path, want: dict[str, int]) -> str:
    """"" when the file at ``path`` has the size and CRC32 of the manifest entry ``want``; else
    how it differs. ``OSError`` (a missing file) as ``stat`` raises it."""
    size = path.stat().st_size
    if size != want["bytes"]:
        return f"{size} bytes, the manifest says {want['bytes']} (truncated or replaced)"
    crc = _file_crc(path)
    if crc != want["crc32"]:
        return f"checksum mismatch (crc32 {crc:08x}, expected {want['crc32']:08x}): the file is corrupted"
    return ""


def read_manifest(marker: Path) -> dict[str, Any]:
    """A manifest (a checkpoint's ``COMPLETE``, a run's ``manifest.json``) whose ``files`` map
    names to ``{bytes, crc32}``; :class:`CheckpointError` naming it when it is not one."""
    try:
        manifest = read_json(marker)
        files = manifest["files"]
        if not isinstance(files, dict) or not all(_is_entry(w) for w in files.values()):
            raise TypeError("'files' is not a map of name -> {bytes, crc32}")
    except FileFormatError as e:
        raise CheckpointError(f"{marker}: unreadable manifest ({e.reason})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{marker}: unreadable manifest ({e})") from None
    return manifest


# --------------------------------------------------------------------------- the run directory's manifest
#
# The files of a run directory that a resume or a report trusts (config.yaml, plan.json,
# run.json) are vouched for as a checkpoint's are: by a manifest of their sizes and CRC32s,
# RUN/manifest.json, in COMPLETE's format. Unlike a checkpoint's, these files are rewritten one
# by one as the run goes (run.json at its start and its end), so a write announces itself
# first: the manifest lists the new entry with the old one as "was", then the file is replaced,
# then the manifest is written without "was". A kill anywhere leaves each file matching an entry
# listed for it; only a file changed by other means matches none.

RUN_MANIFEST = "manifest.json"


def seal_run_files(run_dir: Path, files: dict[str, str | bytes], kept: str = "") -> None:
    """Write ``files`` (name -> content) into ``run_dir``, each atomically and listed in its
    manifest (see above). A write fault is a ``fsio.WriteError`` naming the file, then ``kept``."""
    run_dir = Path(run_dir)
    listed = _listed(run_dir)
    settled = dict(listed)
    for name, data in files.items():
        settled[name] = data_entry(data)
        old = listed.get(name) or (file_entry(run_dir / name) if (run_dir / name).is_file() else None)
        listed[name] = {**settled[name], **({"was": _plain(old)} if old else {})}
    write_json(run_dir / RUN_MANIFEST, {"format": FORMAT_VERSION, "files": listed}, "the run's manifest", kept)
    for name, data in files.items():
        write_file(run_dir / name, data, kept=kept)
    write_json(run_dir / RUN_MANIFEST, {"format": FORMAT_VERSION, "files": settled}, "the run's manifest", kept)


def _is_entry(entry: Any) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("crc32"), int)


def _plain(entry: dict[str, Any]) -> dict[str, int]:
    return {"bytes": entry["bytes"], "crc32": entry["crc32"]}


def _listed(run_dir: Path) -> dict[str, dict[str, Any]]:
    """What the run's manifest lists, each entry as settled (an unreadable or missing manifest:
    nothing; the run's files are checked before they are rewritten)."""
    try:
        files = read_manifest(run_dir / RUN_MANIFEST)["files"]
    except (CheckpointError, OSError):
        return {}
    return {name: _plain(entry) for name, entry in files.items()}


def run_file_problem(run_dir: Path, name: str) -> str | None:
    """Whether ``run_dir/name`` is as the run wrote it: "" when it matches the entry the run's
    manifest lists for it (or the one it had while a write was under way), what is wrong when
    it does not (or the manifest cannot be read), None when the manifest lists no such file (a
    run recorded before the manifest: the caller reads the old form, if there is one).
    ``OSError`` (a missing file) as ``stat`` raises it."""
    manifest = Path(run_dir) / RUN_MANIFEST
    if not manifest.is_file():
        return None
    try:
        entry = read_manifest(manifest)["files"].get(name)
    except CheckpointError as e:
        return f"not vouched for: {e}"
    if entry is None:
        return None
    path = Path(run_dir) / name
    problem = entry_problem(path, entry)
    was = entry.get("was")
    if problem and _is_entry(was) and not entry_problem(path, _plain(was)):
        return ""  # a write the manifest announced was cut short: the file is still the one before it
    return f"changed since the run wrote it ({problem}; {manifest} lists what it wrote)" if problem else ""


def read_run_json(run_dir: Path, name: str) -> Any:
    """The JSON of ``run_dir/name`` (run.json, plan.json), checked against the run's manifest
    first: :class:`CheckpointError` naming the file when it was changed or torn since the run
    wrote it. A file of a run recorded before the manifest is read unchecked, as it was then."""
    path = Path(run_dir) / name
    problem = run_file_problem(run_dir, name)
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    try:
        return read_json(path)
    except FileFormatError as e:
        raise CheckpointError(str(e)) from None
