"""DiLoCo: data parallelism for nodes (or sites) joined by a slow link.

Douillard et al., 2023 ("DiLoCo: Distributed Low-Communication Training of Language Models").
The ranks form **worker groups** of ``parallel.group_size`` ranks (0: the ranks of one node).
Inside a group the ranks train as usual (``parallel.inner_strategy``: DDP, gradients
averaged over the group every step, on the fast link). The groups do not talk for
``parallel.inner_steps`` (H) steps; each trains on its own data with its own optimizer. Then
every group takes its **pseudo-gradient** -- the parameters at the last sync (the *anchor*)
minus its parameters now -- and the groups all-reduce it once (in ``parallel.outer_dtype``).
An **outer** Nesterov SGD (``outer_lr``, ``outer_momentum``) steps the anchor with the mean,
and every group continues from the new anchor. The inner optimizers keep their state.

Communication across groups falls by about H: one all-reduce of the model per H steps
instead of one of the gradients per step. It is sent sharded: rank i of every group
all-reduces the i-th of S slices with its peers in the other groups (``cross`` group), then
the group all-gathers the slices on its own link, so a node's network carries one model,
not S.

**Streaming** (Douillard et al., 2025): ``parallel.fragments`` F splits the parameters into F
contiguous fragments of about equal size; fragment f syncs at inner steps
``(f + 1) H / F`` (mod H), so the bytes spread over the H steps. With
``parallel.overlap_steps`` τ > 0 a fragment's all-reduce is issued asynchronously and
lands τ steps later (NCCL runs it on its own stream; gloo in its own thread), while the
group trains on; on landing the fragment becomes the new anchor plus the progress the
group made since it sent. With τ = 0 every group holds the anchor itself right after a sync.

Every run ends on a sync of whatever changed since its last one, so the model a run leaves
is the groups' common one. Checkpoints hold the anchor, the outer momentum, each group's
weights and inner optimizer state and any fragment in flight (``dist_checkpoint.py``), so a
resume at any step is exact at the same number of groups (and, with a fragment in flight,
the same H and τ: :meth:`DiLoCo.load_state_dict` refuses others). Another strategy resumes a
DiLoCo checkpoint only from an outer sync (:func:`leave_diloco`).

Measured (:meth:`DiLoCo.window`, into metrics.jsonl): outer steps, the bytes all-reduced
across groups, the seconds the step waited on that communication, the outer learning rate,
and for every outer step (an ``outer_sync`` row each) the pseudo-gradient's norm and how far
the groups had drifted apart before the sync.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from flopwise.config import ConfigError, ParallelConfig
from flopwise.parallel.distributed import DistEnv, all_gather_into

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_CHUNK = 1 << 22  # values per chunk of the drift's float64 sums (32 MiB of temporaries)


@dataclass
class Groups:
    """This rank's place among the worker groups."""

    index: int = 0  # which group
    count: int = 1  # G
    size: int = 1  # S: ranks per group
    inner_rank: int = 0  # this rank within its group
    inner: Any = None  # the group's process group (gradients inside it); None when S == 1
    cross: Any = None  # this rank and its peers of the same inner rank in every group; None when G == 1


def group_size(pc: ParallelConfig, world: int, environ: dict[str, str] | None = None) -> int:
    """``parallel.group_size``, with 0 meaning the ranks of one node (torchrun's LOCAL_WORLD_SIZE)."""
    if pc.group_size:
        return pc.group_size
    env = os.environ if environ is None else environ
    return max(1, int(env.get("LOCAL_WORLD_SIZE", "") or world))


def layout_problems(pc: ParallelConfig, world: int, environ: dict[str, str] | None = None) -> list[str]:
    """Why ``world`` ranks cannot be cut into DiLoCo groups as configured (empty when they can)."""
    size = group_size(pc, world, environ)
    if world % size:
        how = f"parallel.group_size={pc.group_size}" if pc.group_size else f"the {size} ranks per node"
        return [f"parallel.strategy=diloco: {how} does not divide the {world} ranks into whole groups; "
                f"set parallel.group_size to a divisor of {world}"]
    return []


def make_groups(env: DistEnv, pc: ParallelConfig) -> Groups:
    """The process groups of this rank's worker group and of its peers across groups (every
    rank creates every group, in the same order, as ``new_subgroups_by_enumeration`` needs)."""
    world = env.world_size
    size = group_size(pc, world)
    count = world // size
    g = Groups(env.rank // size, count, size, env.rank % size)
    if not env.distributed:
        return g
    if size > 1:
        g.inner, _ = dist.new_subgroups_by_enumeration([list(range(k * size, (k + 1) * size)) for k in range(count)])
    if count > 1:
        g.cross, _ = dist.new_subgroups_by_enumeration([list(range(i, world, size)) for i in range(size)])
    return g


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of parameter ``p`` (its shard under FSDP2), sharing storage."""
    return p.to_local() if hasattr(p, "to_local") else p


def fragments(sizes: list[int], count: int) -> list[list[int]]:
    """Indices of ``sizes`` cut into ``count`` contiguous runs of about equal total size."""
    if count > len(sizes):
        raise ConfigError([f"parallel.fragments={count} but the model has {len(sizes)} parameter tensors"])
    total, acc = sum(sizes), 0
    out: list[list[int]] = [[]]
    for i, n in enumerate(sizes):
        left = count - len(out)  # fragments still to start
        # a new fragment once this one holds its share, or when each tensor left must start one
        if out[-1] and left > 0 and (acc >= len(out) * total / count or len(sizes) - i == left):
            out.append([])
        out[-1].append(i)
        acc += n
    return out


def leave_diloco(state: dict[str, Any], group: dict[str, Any], step: int, where: str, strategy: str) -> str:
    """A DiLoCo checkpoint (``state``: its outer state, ``group``: group 0's part) resumed under
    another ``strategy``, which reads group 0's weights only: refused between outer syncs,
    where the other groups' weights, the anchor and the outer momentum are still the run's
    (ConfigError naming what would be dropped); at a sync point -- every fragment synced after
    step ``step`` with none in flight, so every group holds the anchor -- the note for the log:
    only the outer momentum is left behind."""
    flights = group.get("inflight") or []
    last_sent = list(state.get("last_sent") or [])
    if flights or not last_sent or any(s != step for s in last_sent):
        why = (f"fragment(s) {', '.join(str(f['fragment']) for f in flights)} in flight" if flights else
               f"its fragments last synced after step(s) {', '.join(map(str, sorted(set(last_sent))))}")
        raise ConfigError([f"{where}: saved by DiLoCo between outer syncs (step {step}; {why}): its "
                           f"{state.get('groups')} worker group(s) hold their own weights beside the anchor and the "
                           f"outer momentum, and parallel.strategy={strategy} would keep group 0's weights only. "
                           "Resume it with parallel.strategy=diloco and the launch that saved it, or from a "
                           "checkpoint taken at a sync point (every fragment synced, none in flight: with "
                           "parallel.fragments=1 and overlap_steps=0 every parallel.inner_steps steps; a run's last)"])
    return (f"{Path(where).name} was saved by DiLoCo at an outer sync (every group held these weights): it "
            f"continues under {strategy}; the outer momentum is left behind")


@dataclass
class _InFlight:
    """A fragment's pseudo-gradient on its way: sent after step ``sent``, lands after ``land``."""

    fragment: int
    sent: int
    land: int
    delta: torch.Tensor  # this group's pseudo-gradient of the fragment (fp32, flat), as sent
    buffer: torch.Tensor | None = None  # what is all-reduced (outer dtype, padded to S slices)
    work: Any = None  # the async all-reduce


@dataclass
class _Window:
    """What the outer syncs measured since the last log row."""

    seconds: float = 0.0
    events: list[tuple[Any, Any]] = field(default_factory=list)


class DiLoCo:
    """The outer loop of a DiLoCo run over ``params`` (what the inner optimizer steps, fp32).

    :meth:`after_step` is called after every inner step; it syncs the fragments that are due."""

    def __init__(self, params: list[torch.nn.Parameter], pc: ParallelConfig, groups: Groups, device: torch.device,
                 on_sync: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter):
        self.g, self.device, self.on_sync, self.clock = groups, device, on_sync, clock
        self.H, self.tau = pc.inner_steps, pc.overlap_steps
        self.dtype = DTYPES[pc.outer_dtype]
        self.locals = [_local(p) for p in params]
        # DDP inside a group: every rank holds the group's whole pseudo-gradient, so each sends
        # one slice of it across groups and the group all-gathers them; FSDP2: each its shard
        self.slices = groups.size if groups.inner is not None and pc.inner_strategy == "ddp" else 1
        self.sharded = groups.inner is not None and pc.inner_strategy == "fsdp2"  # each rank's state its own
        with torch.no_grad():
            self.anchor = [t.detach().float().clone() for t in self.locals]
        self.outer = torch.optim.SGD(self.anchor, lr=pc.outer_lr, momentum=pc.outer_momentum,
                                     nesterov=pc.outer_momentum > 0)
        self.frags = fragments([t.numel() for t in self.locals], pc.fragments)
        self.last_sent = [0] * len(self.frags)
        self.inflight: list[_InFlight] = []
        # cross-group payload of one full round (every fragment once), summed over this group's ranks
        shards = groups.size if groups.inner is not None and self.slices == 1 else 1  # FSDP2: S shards of it
        self.round_bytes = sum(t.numel() for t in self.locals) * self.dtype.itemsize * shards
        self.outer_steps = 0  # rounds completed: every fragment synced once more
        self.bytes_sent = 0  # cross-group payload this rank all-reduced, over the run
        # this rank's parts of the squared norms of the round being synced and of the last one:
        # [|d_group - d_mean|^2, |d_mean|^2] over what it holds
        self._round = torch.zeros(2, dtype=torch.float64, device=device)
        self._last_round = torch.zeros(2, dtype=torch.float64, device=device)
        # since the last log row: (outer step, inner step, its round's sums) for each round
        self._rounds: list[tuple[int, int, torch.Tensor]] = []
        self._window = _Window()

    # ------------------------------------------------------------------ the outer loop
    def due(self, step: int) -> list[int]:
        """The fragments that send after inner step ``step`` (1-based: the steps done)."""
        return [f for f in range(len(self.frags)) if step % self.H == (f + 1) * self.H // len(self.frags) % self.H]

    def after_step(self, step: int, last: bool = False) -> None:
        """After inner step ``step``: land the fragments whose overlap ends now, send those due
        (landing at once when τ = 0). On the ``last`` step everything lands, and every fragment
        that trained since its last send syncs now."""
        for landing in [x for x in self.inflight if x.land <= step or last]:
            self._land(landing, step)
        sending = [f for f in range(len(self.frags)) if self.last_sent[f] < step] if last else self.due(step)
        for f in sending:
            flight = self._send(f, step)
            if self.tau == 0 or last:
                self._land(flight, step)

    @torch.no_grad()
    def _send(self, f: int, step: int) -> _InFlight:
        idx = self.frags[f]
        t0 = self._start()
        delta = torch.empty(sum(self.anchor[i].numel() for i in idx), dtype=torch.float32, device=self.device)
        offset = 0
        for i in idx:  # written in place: no temporary the size of the fragment beside it
            n = self.anchor[i].numel()
            torch.sub(self.anchor[i], self.locals[i], out=delta[offset:offset + n].view_as(self.anchor[i]))
            offset += n
        flight = _InFlight(f, step, step + self.tau, delta)
        self.last_sent[f] = step
        self.inflight.append(flight)
        self._issue(flight)
        self.bytes_sent += flight.buffer.numel() // self.slices * flight.buffer.element_size()  # type: ignore[union-attr]
        self._stop(t0)
        return flight

    def _issue(self, flight: _InFlight) -> None:
        """Queue the fragment's all-reduce across groups (sharded over the group's ranks)."""
        n = flight.delta.numel()
        buffer = torch.zeros(-(-n // self.slices) * self.slices, dtype=self.dtype, device=flight.delta.device)
        buffer[:n] = flight.delta
        flight.buffer = buffer
        if self.g.cross is not None:
            flight.work = dist.all_reduce(self._slice(buffer), op=dist.ReduceOp.SUM, group=self.g.cross,
                                          async_op=True)

    def _slice(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a padded buffer (all of it when the group does not slice)."""
        return buffer.view(self.slices, -1)[self.g.inner_rank if self.slices > 1 else 0]

    @torch.no_grad()
    def _land(self, flight: _InFlight, step: int) -> None:
        """Wait for the fragment's mean pseudo-gradient, step the anchor, move the group to it."""
        t0 = self._start()
        self.inflight.remove(flight)
        assert flight.buffer is not None
        if flight.work is not None:
            flight.work.wait()
        mine = self._slice(flight.buffer)
        mine.div_(self.g.count)
        if self.slices > 1:
            all_gather_into(flight.buffer, mine.clone(), self.g.inner)
        mean = flight.buffer[: flight.delta.numel()].float()
        # the drift and the norm over what this rank holds (DDP inside: the whole fragment, as every
        # rank of its group; summed over the world when logged): float64 sums, a chunk at a time
        n = mean.numel()
        for a in range(0, n, _CHUNK):
            d, m = flight.delta[a:min(a + _CHUNK, n)].double(), mean[a:min(a + _CHUNK, n)].double()
            self._round += torch.stack([(d - m).square().sum(), m.square().sum()])
        idx, offset = self.frags[flight.fragment], 0
        progress = []
        for i in idx:
            n = self.anchor[i].numel()
            self.anchor[i].grad = mean[offset:offset + n].view_as(self.anchor[i])
            offset += n
            if flight.sent != step:  # the steps trained since the send are kept on top of the new anchor
                sent = self.anchor[i] - flight.delta[offset - n:offset].view_as(self.anchor[i])
                progress.append(self.locals[i].float() - sent)
        self.outer.step()
        for k, i in enumerate(idx):
            new = self.anchor[i] if not progress else self.anchor[i] + progress[k]
            self.locals[i].copy_(new)
            self.anchor[i].grad = None
        if flight.fragment == len(self.frags) - 1:  # a round ends with its last fragment
            self.outer_steps += 1
            self._last_round.copy_(self._round)
            self._rounds.append((self.outer_steps, step, self._round.clone()))
            self._round.zero_()
        if self.on_sync is not None:
            self.on_sync()
        self._stop(t0)

    # ------------------------------------------------------------------ measuring
    def _start(self) -> float:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._window.events.append((ev, None))
        return self.clock()

    def _stop(self, t0: float) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            start, _ = self._window.events[-1]
            self._window.events[-1] = (start, ev)
        else:
            self._window.seconds += self.clock() - t0

    def window(self, env: DistEnv, tokens: int) -> dict[str, Any]:
        """The outer loop's metrics for a log row (a collective: every rank calls it at the same
        step); the seconds are those since the last row; ``tokens``: trained so far, all ranks."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a log step: the host waits here anyway
            seconds = sum(a.elapsed_time(b) for a, b in self._window.events if b is not None) / 1000
        else:
            seconds = self._window.seconds
        self._window = _Window()
        rounds, self._rounds = self._rounds, []
        each = [x for *_, r in rounds for x in r.tolist()]
        sums = env.sum([*self._last_round.tolist(), float(self.bytes_sent), *each], self.device)
        drift_sq, norm_sq, total_bytes = sums[:3]
        out: dict[str, Any] = {"outer_steps": self.outer_steps, "outer_s": seconds, "outer_lr": self.outer_lr,
                               "outer_bytes": self.round_bytes, "outer_bytes_total": int(total_bytes)}
        if tokens:
            out["outer_bytes_per_token"] = total_bytes / tokens
        if self.outer_steps:
            out.update(self._norms(drift_sq, norm_sq))
        # every outer step since the last row, each with the norms of its own round
        out["outer_rounds"] = [{"outer_step": k, "step": step, "outer_lr": self.outer_lr,
                                **self._norms(sums[3 + 2 * i], sums[4 + 2 * i])}
                               for i, (k, step, _) in enumerate(rounds)]
        return out

    @property
    def outer_lr(self) -> float:
        return float(self.outer.param_groups[0]["lr"])

    def _norms(self, drift_sq: float, norm_sq: float) -> dict[str, float]:
        """A round's pseudo-gradient norm and drift from its squared sums over the world (DDP
        inside a group: each rank counted all of it, so divided by the group's ranks)."""
        drift_sq, norm_sq = drift_sq / self.slices, norm_sq / self.slices
        return {"pseudo_grad_norm": (norm_sq / self.g.count) ** 0.5,
                "drift": (max(drift_sq, 0.0) / self.g.count) ** 0.5}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What every group shares: the anchor, the outer momentum, the counters."""
        return {"anchor": self.anchor, "outer": self.outer.state_dict(), "groups": self.g.count,
                "group_size": self.g.size, "fragments": len(self.frags), "last_sent": list(self.last_sent),
                "outer_steps": self.outer_steps, "bytes_sent": self.bytes_sent,
                "inner_steps": self.H, "overlap_steps": self.tau}

    def group_state(self) -> dict[str, Any]:
        """What is this group's own besides its weights and optimizer: the fragments in flight and
        its part of the drift and norm sums (the same on every rank of the group under DDP)."""
        return {"inflight": [{"fragment": f.fragment, "sent": f.sent, "land": f.land, "delta": f.delta.cpu()}
                             for f in self.inflight],
                "last_round": self._last_round.cpu(), "round": self._round.cpu()}

    @torch.no_grad()
    def reset_anchor(self) -> None:
        """The anchor at the parameters as they are now (a run that starts from another's weights)."""
        for mine, now in zip(self.anchor, self.locals):
            mine.copy_(now)

    def _check_schedule(self, state: dict[str, Any], group: dict[str, Any], where: str) -> None:
        """Refuse another H or τ while fragments are in flight: they were sent, and land, on the
        old schedule, and the new one may send the same fragment again before the first copy
        lands (its pseudo-gradient then counted twice). Without one in flight the next sync
        simply follows the new schedule. Every group has the same fragments in flight, so every
        rank decides alike. A checkpoint from before these were recorded gives τ by its flights."""
        flights = group.get("inflight") or []
        if not flights:
            return
        saved_tau = state.get("overlap_steps", flights[0]["land"] - flights[0]["sent"])
        changed = [f"parallel.{name}={old} (this launch: parallel.{name}={new})"
                   for name, old, new in (("inner_steps", state.get("inner_steps", self.H), self.H),
                                          ("overlap_steps", saved_tau, self.tau)) if old != new]
        if changed:
            sent = ", ".join(f"fragment {f['fragment']} sent after step {f['sent']}" for f in flights)
            raise ConfigError([f"{where}: saved with {' and '.join(changed)} while fragments were in flight "
                               f"({sent}); they would sync twice under the new schedule. Resume with the recorded "
                               "values, or from a checkpoint taken while no fragment was in flight (a run's last "
                               "checkpoint is one)"])

    def load_state_dict(self, state: dict[str, Any], group: dict[str, Any], where: str) -> None:
        """Continue from a checkpoint's ``state`` and this group's ``group`` part; the fragments
        that were in flight are sent again, exactly as they were."""
        if (state.get("groups"), state.get("group_size"), state.get("fragments")) != (
                self.g.count, self.g.size, len(self.frags)):
            raise ConfigError([f"{where}: saved by DiLoCo with {state.get('groups')} group(s) of "
                               f"{state.get('group_size')} rank(s) and {state.get('fragments')} fragment(s); this "
                               f"launch has {self.g.count} of {self.g.size} and {len(self.frags)}: resume with the "
                               "same launch and parallel.group_size, parallel.fragments"])
        self._check_schedule(state, group, where)
        with torch.no_grad():
            for mine, saved in zip(self.anchor, state["anchor"]):
                mine.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        self.last_sent = list(state["last_sent"])
        self.outer_steps = state["outer_steps"]
        self.bytes_sent = state["bytes_sent"]
        self._last_round.copy_(group["last_round"])
        self._round.copy_(group["round"])
        for flight in self.inflight:  # a rollback: what this process sent is finished before it is sent again
            if flight.work is not None:
                flight.work.wait()
        self.inflight = []
        for f in group.get("inflight", []):
            flight = _InFlight(f["fragment"], f["sent"], f["land"], f["delta"].to(self.device))
            self.inflight.append(flight)
            self._issue(flight)  # counted when it was first sent
