"""How every benchmark runs a command: ``run(argv, env=..., timeout_s=..., log=...)`` -> :class:`Ran`.

The command starts in a process group of its own. Its stdout and stderr are read as they
arrive: kept apart for the caller, and interleaved into ``log`` (when one is given) line by
line, so a run cut short still leaves what it printed. At the timeout, or when this script is
interrupted, the whole group is killed (torchrun's ranks and compile workers with it, and what its
members started in sessions of their own: a benchmark run by a benchmark) and waited for; when
the command exits, whatever it left running in its group is killed too. Being in a session of
its own, the command is out of reach of signals sent to this script's process group (``timeout``,
a closed terminal), so while it runs SIGTERM and SIGHUP end this script through ``SystemExit``
and the command's group with it.

A failure or a timeout becomes one line, :attr:`Ran.failure`; :meth:`Ran.report` adds the last
lines of output, and :meth:`Ran.check` raises :class:`RunFailed` with that report.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO


class RunFailed(RuntimeError):
    """A command that exited non-zero or ran out of time; the message is :meth:`Ran.report`."""

    def __init__(self, ran: Ran, lines: int) -> None:
        super().__init__(ran.report(lines))
        self.ran = ran


@dataclass
class Ran:
    """What came back from :func:`run`."""

    argv: list[str]
    rc: int | None  # None: killed at its timeout
    stdout: str
    stderr: str
    output: str  # stdout and stderr interleaved as they arrived (what ``log`` holds)
    elapsed_s: float
    timeout_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.rc == 0

    @property
    def timed_out(self) -> bool:
        return self.rc is None

    @property
    def reason(self) -> str:
        """``""`` when it succeeded, else ``timed out after 80s`` or ``exit 1``."""
        if self.timed_out:
            return f"timed out after {self.timeout_s:g}s"
        return "" if self.ok else f"exit {self.rc}"

    @property
    def last_line(self) -> str:
        """The last non-blank line of stderr, or of stdout when stderr has none."""
        for text in (self.stderr, self.stdout):
            for line in reversed(text.splitlines()):
                if line.strip():
                    return line.strip()
        return ""

    @property
    def failure(self) -> str:
        """One line for a person, ``""`` when it succeeded:
        ``flopwise train --preset tiny: exit 1: ValueError: ...`` or ``...: timed out after 80s``."""
        if self.ok:
            return ""
        last = "" if self.timed_out else self.last_line
        return f"{label(self.argv)}: {self.reason}" + (f": {last[:300]}" if last else "")

    def tail(self, lines: int) -> str:
        """The last ``lines`` lines of output, stdout and stderr interleaved."""
        return "\n".join(self.output.rstrip().splitlines()[-lines:]) if lines > 0 else ""

    def report(self, lines: int = 20) -> str:
        """:attr:`failure`, then the last ``lines`` lines of output under it."""
        return "\n".join(x for x in (self.failure, self.tail(lines)) if x)

    def check(self, lines: int = 20) -> Ran:
        """This result, or :class:`RunFailed` (its :meth:`report`) when the command failed."""
        if not self.ok:
            raise RunFailed(self, lines)
        return self


def label(argv: Sequence[str]) -> str:
    """The first words of a command, for a message: ``flopwise train --preset tiny``."""
    words = [str(a) for a in argv]
    if words and (words[0] == sys.executable or Path(words[0]).name.startswith("python")):
        words = words[1:]
    if words[:1] == ["-m"]:
        words = words[1:]
    if words:
        words[0] = Path(words[0]).name
    text = " ".join(words[:4])
    return text if len(text) <= 80 else text[:77] + "..."


def run(argv: Sequence[str | os.PathLike], *, env: Mapping[str, str | None] | None = None,
        cwd: str | os.PathLike | None = None, timeout_s: float | None = None, log: Path | None = None) -> Ran:
    """Run ``argv`` to its end (or its timeout) and return what it printed and how it ended.

    ``env``: changes to this process's environment (a ``None`` value removes the variable);
    ``cwd``: where it runs (default: here); ``log``: a file that receives the output as it arrives."""
    argv = [str(a) for a in argv]
    child_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            child_env.pop(key, None)
        else:
            child_env[key] = value
    out: list[str] = []
    err: list[str] = []
    both: list[str] = []
    lock = threading.Lock()
    rc: int | None = None
    with contextlib.ExitStack() as stack:
        sink: IO[str] | None = None
        if log is not None:
            Path(log).parent.mkdir(parents=True, exist_ok=True)
            sink = stack.enter_context(open(log, "w", encoding="utf-8"))

        def pump(stream: IO[str], into: list[str]) -> None:
            for line in stream:
                into.append(line)
                with lock:
                    both.append(line)
                    if sink is not None:
                        sink.write(line)
                        sink.flush()

        stack.enter_context(_termination_ends_the_group())
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=cwd, env=child_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
        readers: list[threading.Thread] = []
        try:
            readers += [threading.Thread(target=pump, args=(proc.stdout, out), daemon=True),
                        threading.Thread(target=pump, args=(proc.stderr, err), daemon=True)]
            for t in readers:
                t.start()
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:  # finished, timed out or this script stopped: nothing of the command's group outlives the call
            left = kill_group(proc) if rc is None or group_alive(proc.pid) else []
            for t in readers:
                if t.is_alive():
                    t.join(timeout=5 if left else None)  # a survivor of SIGKILL may hold the pipes open
        elapsed = time.perf_counter() - t0
    return Ran(argv, rc, "".join(out), "".join(err), "".join(both), elapsed, timeout_s)


# --------------------------------------------------------------------------- process groups

@contextlib.contextmanager
def _termination_ends_the_group() -> Iterator[None]:
    """SIGTERM / SIGHUP (where they would end this script anyway) raise ``SystemExit(128 + signal)``
    for the duration, so that :func:`run`'s ``finally`` kills the command's group on the way out."""
    if threading.current_thread() is not threading.main_thread():  # handlers belong to the main thread
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    before = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:  # leave a handler or an ignore (nohup) alone
            before[sig] = signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _processes() -> dict[int, tuple[int, int]]:
    """Every live (not zombie) process: pid -> (parent pid, process group), from /proc (Linux)."""
    table = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if fields[0] not in ("Z", "X"):
            table[int(d)] = (int(fields[1]), int(fields[2]))
    return table


def group_alive(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    return [pid for pid, (_, group) in _processes().items() if group == pgid]


def kill_group(proc: subprocess.Popen, wait_s: float = 30.0) -> list[int]:
    """SIGKILL the process group ``proc`` leads, and the descendants its members started in groups
    of their own (a benchmark run by a benchmark, each through :func:`run`); reap ``proc`` and wait
    up to ``wait_s`` until none is left. The processes still alive then: ``[]`` unless something
    ignores SIGKILL."""
    table = _processes()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    todo = [pid for pid, (_, group) in table.items() if group == proc.pid]
    elsewhere = []  # descendants outside the group, found while their ancestors are alive
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            if table[child][1] != proc.pid:
                elsewhere.append(child)
    for pid in elsewhere:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.perf_counter() + wait_s
    while True:
        table = _processes()
        left = [pid for pid, (_, group) in table.items() if group == proc.pid or pid in elsewhere]
        if not left or time.perf_counter() > deadline:
            return left
        time.sleep(0.01)
