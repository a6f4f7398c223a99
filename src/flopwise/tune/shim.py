"""The fake-CUDA shim: a small C++ library the dry run preloads into its tracing process.

A CPU-only build of torch cannot hold a tensor on device ``cuda`` past its first device guard,
even under ``FakeTensorMode`` where nothing is allocated: indexing, autograd's engine and the
data-parallel wrappers all take one. ``fake_cuda_guard.cpp`` (beside this file) registers no-op
CUDA guard, hooks and a host timer for DDP's reducer. It is compiled here, once per torch
install, against that torch's own headers, and cached under ``~/.cache/flopwise/fake-cuda/``.

Nothing here imports torch: the parent process only builds the library and starts the worker
(``tune/worker.py``) with it preloaded; what cannot be had (no compiler, no headers, a CUDA
build of torch on a machine without a GPU) is a :class:`DryRunUnavailable` of one line that
says what to install.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from flopwise.errors import FlopwiseError

SOURCE = Path(__file__).with_name("fake_cuda_guard.cpp")
BUILD_TIMEOUT_S = 600  # about 15 s on 2 cores; a loaded machine gets far more
CACHE = Path(os.environ.get("FLOPWISE_CACHE", "~/.cache/flopwise")).expanduser() / "fake-cuda"


class DryRunUnavailable(FlopwiseError, RuntimeError):
    """The dry run cannot run on this machine: one line, with what to install."""


@dataclass(frozen=True)
class TorchInstall:
    version: str
    root: Path  # the torch package directory (include/ and lib/ beside __init__.py)

    @property
    def cuda_build(self) -> bool:
        """A CUDA build brings its own CUDA guard and hooks: no shim, but it needs a GPU to trace."""
        return any((self.root / "lib").glob("libtorch_cuda*.so*"))


def torch_install() -> TorchInstall:
    """The torch this Python would import, found without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise DryRunUnavailable("torch is not installed in this Python: ./install.sh installs it")
    return TorchInstall(importlib.metadata.version("torch"), Path(list(spec.submodule_search_locations)[0]))


def compiler() -> str | None:
    """The C++ compiler: $CXX, else g++ or c++ on the PATH."""
    for name in (os.environ.get("CXX", ""), "g++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def shim_path(install: TorchInstall, cache: Path = CACHE) -> Path:
    """Where the shim built for ``install`` lives: one per torch version, location and shim source."""
    key = hashlib.sha256(SOURCE.read_bytes() + f"{install.version}\0{install.root}".encode()).hexdigest()[:12]
    return cache / f"torch-{install.version}-{key}" / "fake_cuda_guard.so"


def ensure_shim(install: TorchInstall | None = None, cache: Path = CACHE, log=lambda s: None) -> Path:
    """The shim for this torch, built on first use (seconds; about 15 on 2 cores) and again
    when the cached library is not the one built (its checksum, written beside it, differs)."""
    install = install or torch_install()
    path = shim_path(install, cache)
    if path.is_dir():
        raise DryRunUnavailable(f"{path} is a directory where the fake-CUDA shim's library goes: remove it "
                                "(the dry run builds the library there)")
    if path.is_file():
        if intact(path):
            return path
        log(f"  the cached fake-CUDA shim {path} is not the library built there (checksum): rebuilding it")
    cxx = compiler()
    if cxx is None:
        raise DryRunUnavailable("the dry run compiles a small C++ library against torch and no C++ compiler was "
                                "found: install g++ (Debian/Ubuntu: apt-get install g++) or set CXX")
    include = install.root / "include"
    if not (include / "c10" / "core" / "impl" / "DeviceGuardImplInterface.h").is_file():
        raise DryRunUnavailable(f"torch {install.version} at {install.root} has no C++ headers (include/): "
                                "reinstall torch from its wheel (./install.sh)")
    _make_cache_dir(path.parent)
    log(f"  building the fake-CUDA shim for torch {install.version} (once; about 15 s) ...")
    lib = install.root / "lib"
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        cmd = [cxx, "-O1", "-shared", "-fPIC", "-std=c++17", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={_cxx11_abi(install)}",
               f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", str(SOURCE),
               f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}", "-o", str(out)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise DryRunUnavailable(f"building the fake-CUDA shim with {cxx} took over {BUILD_TIMEOUT_S} s") from None
        if done.returncode != 0:
            errors = [ln for ln in done.stderr.splitlines() if "error" in ln] or done.stderr.splitlines() or ["?"]
            raise DryRunUnavailable(f"building the fake-CUDA shim for torch {install.version} failed "
                                    f"({errors[0].strip()[:200]}); the dry run is tested with torch 2.13")
        if not _is_library(out):
            raise DryRunUnavailable(f"the C++ compiler {cxx} exited 0 but wrote no library at {out} (an ELF shared "
                                    "object was expected): set CXX to a working g++ or clang++")
        checksum = Path(tmp) / CHECKSUM.format(path.name)
        checksum.write_text(_sha256(out))
        # the checksum first: a library beside a checksum that is not its own is rebuilt, never trusted
        os.replace(checksum, path.with_name(checksum.name))
        os.replace(out, path)  # whole or not at all: a second process building at once is harmless
    return path


CHECKSUM = "{}.sha256"  # beside the library: the sha256 of the library as built


def intact(path: Path) -> bool:
    """Whether the library at ``path`` is the one built there: its checksum matches (a library cut
    short by a full disk, or overwritten, is not; nor one cached before checksums were kept)."""
    try:
        return path.with_name(CHECKSUM.format(path.name)).read_text().strip() == _sha256(path)
    except OSError:
        return False


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _is_library(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _make_cache_dir(where: Path) -> None:
    """``where`` and its parents, or one line naming the file that stands in their way."""
    try:
        where.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocking = next((p for p in (where, *where.parents) if p.exists() and not p.is_dir()), where)
        raise DryRunUnavailable(f"{blocking} is not a directory, and the fake-CUDA shim is cached under it "
                                f"({where}): move it away, or set FLOPWISE_CACHE to another directory") from None


def _cxx11_abi(install: TorchInstall) -> int:
    """Whether this torch was built with the C++11 ABI (every wheel since 2.7), read from its
    build configuration without importing it; 1 when that file is missing."""
    flags = install.root / "share" / "cmake" / "Caffe2" / "Caffe2Targets.cmake"
    try:
        text = flags.read_text(errors="replace")
    except OSError:
        return 1
    return 0 if "_GLIBCXX_USE_CXX11_ABI=0" in text else 1
