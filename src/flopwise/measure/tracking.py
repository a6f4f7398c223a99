"""Experiment tracking beside ``metrics.jsonl``: TensorBoard scalars and Weights & Biases.

:class:`Tracker` fans every metrics row out to the sinks that are on. Rows are flat dicts
of numbers with a ``step``; nested dicts (``eval``: task -> scores, ``grad_norms``: layer ->
norm) become slash-separated names (``eval/arc_easy/acc``). Non-numeric values are left to
``metrics.jsonl``. Only rank 0 tracks. TensorBoard is on by default when the
``tensorboard`` package is installed; W&B only when asked (``tracking.wandb=true``),
``tracking.wandb_mode=offline`` writing locally for a later ``wandb sync``. A sink asked
for explicitly whose package is missing is refused with the install command
(:mod:`flopwise.deps`; ``flopwise train`` checks before it creates the run directory), and W&B
online without an API key where wandb looks for one is refused there too
(:func:`wandb_login_problem`), not wandb's traceback after the run directory was made; so is a
W&B server that does not accept a connection (:func:`wandb_server_problem`), which wandb itself
would wait on for minutes before its ``CommError``.
"""

from __future__ import annotations

import configparser
import contextlib
import math
import netrc
import os
import socket
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from flopwise.config import ConfigError
from flopwise.deps import available, missing_for_tracking, require
from flopwise.fsio import WriteError, is_write_fault, write_error
from flopwise.measure.sinks import JsonlSink


def flatten(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of ``row`` under slash-joined names (bools and None dropped, non-finite kept out)."""
    out: dict[str, float] = {}
    for k, v in row.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{name}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[name] = float(v)
    return out


class TensorBoardSink:
    """TensorBoard scalars. Its writer writes from a thread of its own; a write that fails there
    (a full or read-only disk) is handed to this thread at the next call -- where it becomes a
    WriteError naming the folder -- and not printed as that thread's traceback as well."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is optional ([track])

        self.log_dir = log_dir
        _quiet_writer_thread_faults()
        with self._faults():
            self.writer = SummaryWriter(str(log_dir))

    def write(self, row: dict[str, Any]) -> None:
        step = int(row.get("step", 0))
        with self._faults():
            for name, value in flatten(row).items():
                if name != "step":
                    self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        with self._faults():
            self.writer.close()
            if _writer_thread_faults:  # one its close() did not raise again is not lost silently (one run a process)
                raise _writer_thread_faults.pop(0)

    @contextlib.contextmanager
    def _faults(self):
        try:
            yield
        except Exception as e:
            if e in _writer_thread_faults:
                _writer_thread_faults.remove(e)
            if not is_write_fault(e) or isinstance(e, WriteError):
                raise
            raise write_error(self.log_dir, e, "the TensorBoard events in") from e


_writer_thread_faults: list[BaseException] = []  # write faults TensorBoard's writer threads died of, not yet raised


def _quiet_writer_thread_faults() -> None:
    """Keep ``threading.excepthook`` from printing a write fault of TensorBoard's writer thread
    (``_AsyncWriterThread``): TensorBoard raises it again in the thread that writes next, where
    :class:`TensorBoardSink` reports it in one line. Every other thread exception is printed as before."""
    if getattr(threading.excepthook, "_flopwise", False):
        return
    previous = threading.excepthook

    def hook(args) -> None:
        if (type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, Exception)
                and is_write_fault(args.exc_value)):
            _writer_thread_faults.append(args.exc_value)
            return
        previous(args)

    hook._flopwise = True  # type: ignore[attr-defined]
    threading.excepthook = hook


WANDB_BASE_URL = "https://api.wandb.ai"  # wandb's server unless WANDB_BASE_URL names another


class WandbLoginError(ConfigError):
    """W&B online asked for with no API key to log in with: one line, before any work."""

    def __init__(self, problem: str):
        super().__init__([problem])
        ValueError.__init__(self, problem)  # one line, as a missing package is

    def __reduce__(self):  # rank 0's refusal is pickled to every rank (DistEnv.on_main)
        return (type(self), (self.problems[0],))


def wandb_login_problem(tracking, environ: Mapping[str, str] | None = None) -> str:
    """Why ``tracking`` (a ``TrackingConfig``) cannot log to W&B online, or "": online with no
    API key where wandb itself looks, without importing it or touching the network --
    ``WANDB_API_KEY`` (or ``WANDB_IDENTITY_TOKEN_FILE``), the netrc file (``$NETRC``, else
    ``~/.netrc`` or ``~/_netrc``) for the server of ``WANDB_BASE_URL`` (``wandb login`` writes that
    entry), the ``api_key`` of wandb's settings file. Without a key wandb's ``init`` fails (or,
    at a terminal, waits on a prompt) after the run directory was made."""
    env = os.environ if environ is None else environ
    if not tracking.wandb or tracking.wandb_mode != "online":
        return ""
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE") or _settings_has_key(env):
        return ""
    server = urlsplit(env.get("WANDB_BASE_URL") or WANDB_BASE_URL)
    path = _netrc_path(env)
    fix = ("run `wandb login` (or set WANDB_API_KEY), or set tracking.wandb_mode=offline to log "
           "locally for a later `wandb sync`")
    try:
        found = netrc.netrc(str(path)) if path.is_file() else None
    except (netrc.NetrcParseError, OSError, UnicodeDecodeError) as e:  # wandb finds no key in it either
        why = (f"line {e.lineno}: {e.msg}" if isinstance(e, netrc.NetrcParseError)
               else getattr(e, "strerror", None) or str(e))
        return f"tracking.wandb_mode=online: WANDB_API_KEY is unset and {path} cannot be read ({why}): {fix}"
    # wandb looks the server up with its port (wandb >= 0.2x), requests without: either entry serves
    entries = [found.authenticators(name) for name in (server.netloc, server.hostname or "")] if found else []
    if any(e and e[2] for e in entries):
        return ""
    return (f"tracking.wandb_mode=online needs a W&B API key: WANDB_API_KEY is unset and {path} has no "
            f"entry for {server.netloc}: {fix}")


def _netrc_path(env: Mapping[str, str]) -> Path:
    """The netrc file wandb reads: ``$NETRC``, else the first of ``~/.netrc`` and ``~/_netrc``
    that exists (``~/.netrc`` when neither does)."""
    if env.get("NETRC"):
        return Path(os.path.expanduser(env["NETRC"]))
    home = Path(env.get("HOME") or Path.home())
    return next((home / n for n in (".netrc", "_netrc") if (home / n).exists()), home / ".netrc")


def _settings_has_key(env: Mapping[str, str]) -> bool:
    """Whether wandb's global settings file (``$WANDB_CONFIG_DIR/settings``, else
    ``~/.config/wandb/settings``) holds an ``api_key``; one it cannot parse holds none."""
    home = Path(env.get("HOME") or Path.home())
    folder = Path(env["WANDB_CONFIG_DIR"]) if env.get("WANDB_CONFIG_DIR") else home / ".config" / "wandb"
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(folder / "settings", encoding="utf-8")
    except (configparser.Error, OSError, UnicodeDecodeError):
        return False
    return bool(parser.get("default", "api_key", fallback=""))


# How long the check before the run directory waits for W&B's server to accept a connection. wandb's
# own init waits ~90 s and more before its CommError; a server that does not answer a TCP connect in
# this long is not one a run should wait on. FLOPWISE_WANDB_CONNECT_TIMEOUT overrides it (seconds).
WANDB_CONNECT_TIMEOUT_S = 10.0


def wandb_server_problem(tracking, environ: Mapping[str, str] | None = None) -> str:
    """Why W&B online cannot reach its server, or "": a TCP connection to the host and port of
    ``WANDB_BASE_URL`` (default wandb's own) within the timeout -- or to the proxy that wandb's
    HTTP client would go through (``HTTPS_PROXY`` and the like, unless ``NO_PROXY`` names the
    host). Not a login: the key was checked by :func:`wandb_login_problem`; this finds the server
    that is down, a wrong URL, no network."""
    env = os.environ if environ is None else environ
    if not tracking.wandb or tracking.wandb_mode != "online":
        return ""
    url = env.get("WANDB_BASE_URL") or WANDB_BASE_URL
    server = urlsplit(url)
    proxy = _proxy_for(server.scheme, server.hostname or "", env)
    target = urlsplit(proxy) if proxy else server
    port = target.port or {"https": 443, "http": 80}.get(target.scheme, 1080)  # 1080: a SOCKS proxy's
    raw = env.get("FLOPWISE_WANDB_CONNECT_TIMEOUT") or str(WANDB_CONNECT_TIMEOUT_S)
    try:
        timeout = float(raw)
    except ValueError:
        timeout = math.nan
    if not timeout > 0:
        return f"FLOPWISE_WANDB_CONNECT_TIMEOUT={raw!r}: not a number of seconds above 0"
    try:
        with socket.create_connection((target.hostname or "", port), timeout=timeout):
            return ""
    except OSError as e:
        why = "no answer in {:g} s".format(timeout) if isinstance(e, TimeoutError) else (e.strerror or str(e))
        via = f" through the proxy {proxy}" if proxy else ""
        return (f"tracking.wandb_mode=online: the W&B server {url} cannot be reached{via} ({why}): check "
                f"WANDB_BASE_URL{', the proxy' if proxy else ''} and the network, or set "
                "tracking.wandb_mode=offline to log locally for a later `wandb sync`")


def _proxy_for(scheme: str, host: str, env: Mapping[str, str]) -> str:
    """The proxy URL that an HTTP client reading the environment (wandb's, requests) uses for
    ``host``, or "": ``https_proxy`` / ``http_proxy`` by the scheme, else ``all_proxy`` (either
    case), unless ``no_proxy`` is ``*`` or names the host or a domain above it."""
    low = {k.lower(): v for k, v in env.items() if k.lower().endswith("proxy") and v}
    skip = [h.strip().lstrip(".").lower() for h in low.get("no_proxy", "").split(",") if h.strip()]
    host = host.lower()
    if "*" in skip or any(host == h or host.endswith("." + h) for h in skip):
        return ""
    proxy = low.get(f"{scheme}_proxy") or low.get("all_proxy") or ""
    return proxy if "://" in proxy or not proxy else f"http://{proxy}"


def check_wandb_login(tracking) -> None:
    """Raise :class:`WandbLoginError` when W&B online has no key (:func:`wandb_login_problem`) or
    its server cannot be reached (:func:`wandb_server_problem`): before the run directory is made."""
    problem = wandb_login_problem(tracking) or wandb_server_problem(tracking)
    if problem:
        raise WandbLoginError(problem)


class WandbSink:
    def __init__(self, run_dir: Path, project: str, mode: str, config: dict[str, Any], name: str):
        import wandb  # lazy: wandb is optional

        try:
            self.run = wandb.init(project=project, mode=mode, dir=str(run_dir), config=config, name=name,
                                  resume="allow", id=_wandb_id(run_dir))
        except Exception as e:  # noqa: BLE001 - wandb's CommError, UsageError, ...: one line, not its traceback
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise WandbLoginError(f"W&B did not start ({type(e).__name__}: {first}): set "
                                  "tracking.wandb_mode=offline to log locally for a later `wandb sync`, or "
                                  "tracking.wandb=false") from None

    def write(self, row: dict[str, Any]) -> None:
        flat = flatten(row)
        step = int(flat.pop("step", 0))
        self.run.log(flat, step=step)

    def close(self) -> None:
        self.run.finish()


def _wandb_id(run_dir: Path) -> str:
    """One W&B run per run directory, so a resumed run continues its curves."""
    f = run_dir / "wandb-id.txt"
    if f.is_file():
        return f.read_text().strip()
    rid = uuid.uuid4().hex[:12]
    f.write_text(rid + "\n")
    return rid


class Tracker:
    """``metrics.jsonl`` always; TensorBoard and W&B as configured."""

    def __init__(self, run_dir: Path, tracking, config: dict[str, Any], name: str):
        require(missing_for_tracking(tracking))  # before metrics.jsonl is opened (train checks earlier still)
        check_wandb_login(tracking)
        self.sinks: list[Any] = [JsonlSink(run_dir / "metrics.jsonl")]
        self.notes: list[str] = []  # a sink left out, and why: said once in the run's header
        tb = tracking.tensorboard
        if tb == "true" or (tb == "auto" and available("tensorboard")):
            self._open_tensorboard(run_dir / "tensorboard", tb)
        if tracking.wandb:
            self.sinks.append(WandbSink(run_dir, tracking.wandb_project, tracking.wandb_mode, config, name))
        labels = {"JsonlSink": "metrics.jsonl", "TensorBoardSink": "TensorBoard", "WandbSink": "W&B"}
        self.names = [labels[type(s).__name__] for s in self.sinks]

    def _open_tensorboard(self, path: Path, tb: str) -> None:
        """TensorBoard's sink at ``path``. What keeps it from being a directory of event files (a
        file or a dangling link there, the package unusable) is a :class:`ConfigError` under
        ``tracking.tensorboard=true`` and, under ``auto``, a note: the run goes on without it."""
        problem = tensorboard_dir_problem(path)
        if problem is None:
            try:
                self.sinks.append(TensorBoardSink(path))
                return
            except ImportError as e:
                problem = f"TensorBoard is not usable: {e} (pip install 'flopwise[track]')"
            except OSError as e:
                problem = f"{path}: {e.strerror or e}"
        if tb == "true":
            raise ConfigError([f"tracking.tensorboard=true: {problem}"])
        self.notes.append(f"TensorBoard off: {problem} (tracking.tensorboard=auto; metrics.jsonl has every row)")

    def write(self, row: dict[str, Any]) -> None:
        for s in self.sinks:
            s.write(row)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def tensorboard_dir_problem(path: Path) -> str | None:
    """Why TensorBoard's event files cannot go in ``path`` (RUN/tensorboard), or None: something
    other than a directory is there, or a link to nothing."""
    if path.is_symlink() and not path.exists():
        return f"{path} is a link to {os.readlink(path)}, which does not exist: remove the link or make its target"
    if path.exists() and not path.is_dir():
        return f"{path} is a file, not a directory: move it away (TensorBoard writes its event files there)"
    return None


class NullTracker:
    """What ranks other than 0 write metrics to: nothing (rank 0 writes the run's metrics)."""

    names: list[str] = []

    def write(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
