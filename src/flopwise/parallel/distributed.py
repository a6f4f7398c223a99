"""The process group: who this process is among the ranks `torchrun` started, and the
few collectives the trainer needs.

`torchrun` (or any launcher that sets the same variables) gives every process ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. With none of them
set, the run is one process. With only some of them set -- a hand-written launch script
that forgot one -- the run refuses at once, naming the missing ones, instead of hanging
at the first collective. A strategy that needs a process group (``ddp``, ``zero1``,
``fsdp2``) asked for in a single plain process gets a one-process group, so the same code
path runs (useful to check it on one GPU).

Every rank runs the same loop in lockstep; only rank 0 (``is_main``) logs and writes the
run's non-sharded files. Decisions that could differ between ranks -- a signal that
reached one process, a clock-based deadline, a non-finite loss on one shard of the
batch -- are reduced across ranks so all of them stop (or skip) together.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator, TypeVar, cast

import torch
import torch.distributed as dist

from flopwise.config import ConfigError
from flopwise.errors import FlopwiseError

T = TypeVar("T")

ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# What gloo, NCCL and c10d say when the other end of a collective is gone ...
PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited",
             "socket closed", "ncclremoteerror", "communicator was aborted", "pair closure")
# ... or did not answer within the process group's timeout (parallel.timeout_min)
PEER_SILENT = ("timed out", "timeout")
_FROM_COMMS = ("gloo", "nccl", "c10d", "processgroup", "tcpstore")
_PEER_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:(\d+)")  # gloo's "Connection closed by peer [10.0.0.2]:45203"
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*:\d+\]\s*")  # "[/__w/.../gloo/transport/tcp/pair.cc:553] "


class PeerFailure(FlopwiseError, RuntimeError):
    """This rank stops because another rank of the job died, hung or left mid-collective."""


@dataclass
class DistEnv:
    """This process's place in the run (one process: rank 0 of 1, no process group)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str | None = None  # None: no process group
    launched: str = "one process"  # how the ranks were started, for the log
    group: Any = None  # the process group gradients are averaged over (a DiLoCo worker group); None: all ranks
    _owns_group: bool = field(default=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    # ----------------------------------------------------------------- collectives
    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        """Element-wise sum over ranks of a few floats (one collective; float64)."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device(device))
        dist.all_reduce(t)
        return t.tolist()

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks of a tensor on this rank's communication device."""
        if self.distributed:
            dist.all_reduce(t)
        return t

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank (picklable objects)."""
        if not self.distributed:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return cast(T, box[0])  # rank 0's obj on every rank now

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` as a list on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def on_main(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 only and hand its result -- or its exception -- to every rank,
        so a refusal on rank 0 (a config error, an unwritable run directory) stops all ranks
        with the same message instead of leaving the others waiting at the next collective."""
        result: Any = None
        error: BaseException | None = None
        if self.is_main:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                error = e
        result, error = self.broadcast((result, error))
        if error is not None:
            raise error
        return result

    def on_every_rank(self, fn: Callable[[], T]) -> T:
        """``fn`` on every rank; the first failing rank's exception is raised on all of them,
        so a check that one rank fails (its free memory) stops every rank with its message."""
        if not self.distributed:
            return fn()
        return self._in_turn(fn, True)  # type: ignore[return-value]

    def main_first(self, fn: Callable[[], T]) -> T:
        """``fn`` on rank 0, then on the first rank of every other node, then on the rest: for
        work that creates something once (preparing the embedded corpus into a cache) and can
        then be opened by everyone -- once per node when each node has its own cache
        directory, and never by two processes at once on one filesystem."""
        if not self.distributed:
            return fn()
        value = self.on_main(fn)  # rank 0's failure stops every rank with its message
        later = self._in_turn(fn, not self.is_main and self.local_rank == 0)
        last = self._in_turn(fn, self.local_rank != 0)
        # each rank's own result: the call of the three where ``fn`` ran on it
        return value if self.is_main else cast(T, later if self.local_rank == 0 else last)

    def _in_turn(self, fn: Callable[[], T], mine: bool) -> T | None:
        """``fn`` on the ranks where ``mine``; a failure on any of them is raised on all."""
        result, error = None, None
        if mine:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - re-raised below
                error = e
        errors: list[tuple[int, BaseException] | None] = [None] * self.world_size
        dist.all_gather_object(errors, (self.rank, error) if error is not None else None)
        failed = [e for e in errors if e is not None]
        if error is not None:
            raise error
        if failed:
            raise failed[0][1]  # the first failing rank's exception, as it raised it
        return result

    def peer_failure(self, err: BaseException, timeout_min: float | None = None) -> PeerFailure | None:
        """``err`` as the one line this rank stops with when it is a collective that failed
        because another rank died, hung or left (gloo's "Connection closed by peer", NCCL's
        remote error, a timeout of the process group); None for anything else, which keeps
        its own message or traceback. Which rank is gone is known in a 2-rank job (the other
        one); otherwise gloo names only the peer's address."""
        if not self.distributed or self.world_size < 2 or isinstance(err, FlopwiseError):
            return None
        if not isinstance(err, RuntimeError):  # dist.DistError and gloo's errors are RuntimeErrors
            return None
        text = " ".join(str(err).split())
        low = text.lower()
        if not (isinstance(err, dist.DistError) or any(k in low for k in _FROM_COMMS)):
            return None
        gone = next((k for k in PEER_GONE if k in low), None)
        silent = None if gone else next((k for k in PEER_SILENT if k in low), None)
        if gone is None and silent is None:
            return None
        peer = f"rank {1 - self.rank}" if self.world_size == 2 else "another rank"
        # the backend's sentence that says it, without its source location and advice
        what = next((x for x in re.split(r"\.\s+", text) if (gone or silent) in x.lower()), text)
        what = _SOURCE_LOCATION.sub("", what).strip()[:200]
        address = _PEER_ADDRESS.search(what)
        at = f" at {address.group(1)}:{address.group(2)}" if address and self.world_size > 2 else ""
        backend = self.backend or "the process group"
        limit = f" within parallel.timeout_min={timeout_min:g}" if timeout_min is not None else ""
        whose = peer if self.world_size == 2 else "that rank"
        if gone:
            return PeerFailure(f"rank {self.rank} stops: {peer}{at} died or left the job ({backend}: {what}); "
                               f"{whose}'s own output says why (torchrun's failure summary names the first rank "
                               "that failed and its exit code)")
        return PeerFailure(f"rank {self.rank} stops: {peer}{at} did not answer{limit} ({backend}: {what}): it "
                           f"died, hung or left the job; {whose}'s own output says why")

    def _comm_device(self, device: torch.device) -> torch.device:
        return device if self.backend == "nccl" else torch.device("cpu")

    def close(self) -> None:
        """Tear down the process group this rank joined (a no-op for one it did not create).

        A DDP wrapper's reducer is a C++ object holding the group; freed while holding the GIL,
        if it holds the group's last reference, the group's destructor joins gloo's worker
        threads while one of them waits for the GIL to release a finished collective's tensor:
        a rank that hangs after its run succeeded (seen on a loaded 2-core CPU, rank 0 of 4,
        ddp). So the wrappers go first -- the caller has dropped its model, and the collection
        frees what only reference cycles still hold -- and the group is destroyed here, where
        torch releases the GIL while it joins those threads."""
        if self._owns_group and dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()
            self._owns_group = False

    @contextlib.contextmanager
    def closing(self) -> Iterator[None]:
        """:meth:`close` after the block, however it ends. The block's calls should own the
        model (a DDP wrapper) in their frames, which end before the close. An error's traceback
        would keep those frames and their locals past it: they are cleared first (their lines
        stay, for a traceback), so the wrapper goes before the group on that path too."""
        try:
            yield
        except BaseException as err:
            traceback.clear_frames(err.__traceback__)
            raise
        finally:
            self.close()


def all_gather_into(out: torch.Tensor, mine: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """Every rank's ``mine`` (the same size on each) concatenated into ``out``, rank by rank; with
    ``async_op`` its work handle, to ``wait()`` on (torch >= 2.13 names it all_gather_single)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, mine, group=group, async_op=async_op)


def read_launch_env(environ: dict[str, str] | None = None) -> tuple[int, int, int] | None:
    """(rank, local_rank, world_size) from torchrun's variables; None when none are set.

    Half-set variables are a :class:`ConfigError` naming what is missing or wrong."""
    env = os.environ if environ is None else environ
    present = [v for v in ENV_VARS if env.get(v, "") != ""]
    if not present:
        return None
    missing = [v for v in ENV_VARS if v not in present]
    if missing:
        raise ConfigError([
            f"distributed launch: {', '.join(present)} set but {', '.join(missing)} not; launch with "
            "`torchrun --nproc-per-node=N -m flopwise train ...` (which sets all of "
            f"{', '.join(ENV_VARS)}), or unset them to train in one process"
        ])
    values = {}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        try:
            values[name] = int(env[name])
        except ValueError:
            raise ConfigError([f"distributed launch: {name}={env[name]!r} is not an integer"]) from None
    rank, local, world = values["RANK"], values["LOCAL_RANK"], values["WORLD_SIZE"]
    if world < 1 or not 0 <= rank < world:
        raise ConfigError([f"distributed launch: RANK={rank} with WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE"])
    if local < 0 or local > rank:
        raise ConfigError([f"distributed launch: LOCAL_RANK={local} with RANK={rank}: need 0 <= LOCAL_RANK <= RANK"])
    return rank, local, world


def _import_before_the_group() -> None:
    """Import ``torch.distributed.nn.functional`` while no process group exists.

    Its collectives take ``group=group.WORLD`` as a default argument, evaluated at import:
    imported after ``init_process_group`` (torch._dynamo imports it on first use -- a
    compile, or even ``nn.init`` on the meta device), ten function defaults hold the default
    group, so ``destroy_process_group`` cannot free it and gloo's worker threads outlive it.
    At interpreter exit such a thread may then release a finished collective that holds a
    Python tensor, take the GIL during finalisation and abort the process ("terminate
    called without an active exception", SIGABRT) after a run that succeeded. Imported
    first, the defaults are None and the group is freed at :meth:`DistEnv.close`. (Where the
    module cannot be imported, torch._dynamo cannot import it either.)"""
    try:
        import torch.distributed.nn.functional  # noqa: F401 - for its side effect, see above
    except ImportError:
        pass


def init_distributed(strategy: str, device_name: str, backend: str = "auto", timeout_min: float = 30.0,
                     environ: dict[str, str] | None = None) -> tuple[DistEnv, torch.device]:
    """Join the process group the launcher describes (or none) and pick this rank's device.

    On CUDA each rank takes ``cuda:LOCAL_RANK``; ``train.device=cuda:N`` is refused under a
    multi-process launch (the launcher decides which GPU is whose). NCCL on CUDA, gloo on CPU."""
    launch = read_launch_env(environ)
    if launch is None and strategy in ("auto", "single"):
        return DistEnv(), resolve_device(device_name)
    if launch is not None and launch[2] > 1 and strategy == "single":
        raise ConfigError([f"parallel.strategy=single but {launch[2]} processes were launched (WORLD_SIZE="
                           f"{launch[2]}): choose auto, ddp, zero1 or fsdp2, or launch one process"])
    rank, local, world = launch if launch is not None else (0, 0, 1)
    cuda = device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available())
    if cuda:
        if not torch.cuda.is_available():
            raise ConfigError([f"train.device={device_name!r} but CUDA is not available on this machine"])
        if device_name.startswith("cuda:") and world > 1:
            raise ConfigError([f"train.device={device_name!r} under a {world}-process launch: each rank uses "
                               "cuda:LOCAL_RANK; set train.device=cuda or auto (CUDA_VISIBLE_DEVICES picks the GPUs)"])
        if local >= torch.cuda.device_count():
            raise ConfigError([f"LOCAL_RANK={local} but this node has {torch.cuda.device_count()} visible GPU(s): "
                               "--nproc-per-node must not exceed the GPUs per node"])
        device = torch.device(device_name if device_name.startswith("cuda:") else f"cuda:{local}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    chosen = backend if backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if chosen == "nccl" and device.type != "cuda":
        raise ConfigError(["parallel.backend=nccl needs CUDA devices; use gloo (or auto) on CPU"])
    timeout = timedelta(minutes=timeout_min)
    _import_before_the_group()
    if dist.is_initialized():  # a caller (a test, a notebook) set the group up already
        return DistEnv(dist.get_rank(), local, dist.get_world_size(), dist.get_backend(), "existing group"), device
    if launch is None:  # a strategy that needs a group, in one plain process: a group of one
        dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        launched = "one process (a one-rank process group)"
    else:
        kwargs: dict[str, Any] = {"timeout": timeout}
        if chosen == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(chosen, **kwargs)
        nodes = world // max(int(os.environ.get("LOCAL_WORLD_SIZE", world) or world), 1)
        launched = f"{world} processes" + (f" on {nodes} nodes" if nodes > 1 else "")
    return DistEnv(rank, local, world, chosen, launched, _owns_group=True), device


def resolve_device(name: str) -> torch.device:
    """``train.device`` of a one-process run: ``auto`` is CUDA when there is one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError([f"train.device={name!r} but CUDA is not available on this machine"])
    return device
