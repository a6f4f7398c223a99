"""One optimizer step, top to bottom, with no host read; what happens to a bad one.

:func:`train_step`: the learning rate; forward and backward over the step's micro-batches
(gradient accumulation; under data parallelism the gradients are averaged on the last
one); fp32 master gradients; loss-scale unscaling; clipping; the step's values -- loss,
gradient norm, whether the step is bad, the ranks' stop votes -- in one tensor, summed over
ranks by one tiny all-reduce; optional per-layer statistics; the optimizer step, which a bad
step (a loss or gradients that are not finite) leaves undone *on the device*
(``optim.skipped_if``). Nothing in it waits for the device: it returns a :class:`PendingStep`,
whose values are copied to the host without blocking. The loop reads a step's values on
the steps that log, evaluate or save (:meth:`PendingStep.read`), and every other step's one
step late, once the next step is queued -- so a GPU is never idle waiting for the host to
decide. The guard's policies act on what is read (:func:`settle`): at most one step late, with
the same outcome (:func:`handle_bad_step`: stop, skip or rollback; a collapse).

An optimizer that cannot skip on the device (``optim.fused=false``: torch's non-fused AdamW)
reads the values before its update instead -- one host sync per step, said in the run's summary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from flopwise.config import RunConfig
from flopwise.fsio import write_json
from flopwise.measure.timing import StepTimer, nvtx
from flopwise.model.loss import make_loss_fn
from flopwise.parallel.distributed import DistEnv
from flopwise.parallel.strategy import Strategy, clip_grad_norm, grad_sync, grads_set_to_none, shards_parameters
from flopwise.train.optim import CombinedOptimizer, set_lr, set_lr_factor, skipped_if, skips_on_device
from flopwise.train.precision import MasterWeights, Precision, autocast_factory, fp8_scales_for_fsdp
from flopwise.train.setup import Run, StepParts, grad_clip
from flopwise.train.stopping import NonFiniteError


@dataclass(frozen=True)
class StepFixed:
    """What set-up fixed about every step, decided once: whether the optimizer skips a bad step
    on the device (:func:`~flopwise.train.optim.skips_on_device`; else the step is read before
    its update), and whether fp16 loss scaling is on (the scaler then skips an overflowing
    update, and a non-finite loss reaches it as overflowing gradients: :func:`forward_backward`)."""

    on_device: bool
    fp16: bool
    set_to_none: bool  # zero_grad drops the gradients (``parallel.strategy.grads_set_to_none``)
    fp8_gather: bool = False  # FSDP2 all-gathers fp8 weights: their scales are computed after each update

    @classmethod
    def of(cls, optimizer: Any, scaler: Any, strategy: str, cfg: Any = None) -> "StepFixed":
        t = cfg.train if cfg is not None else None
        return cls(on_device=skips_on_device(optimizer), fp16=scaler is not None and scaler.is_enabled(),
                   set_to_none=grads_set_to_none(strategy),
                   fp8_gather=bool(t and t.fp8 and t.fp8_recipe == "tensorwise" and shards_parameters(strategy)))


@dataclass
class StepOnly:
    """A step without the run around it -- what a preflight trial times and the dry run traces:
    the parts ``setup.build_step`` makes (as the trainer's run holds them), a loader, a timer."""

    cfg: Any
    env: DistEnv
    timer: StepTimer
    prec: Any
    optimizer: Any
    strategy: Strategy
    train_model: torch.nn.Module
    train_loader: Any
    world: int
    autocast: Callable[[], Any]
    loss_fn: Callable
    master: MasterWeights | None
    opt_params: list[torch.nn.Parameter]
    clip: float
    state_model: torch.nn.Module
    fixed: StepFixed

    @classmethod
    def of(cls, cfg: RunConfig, parts: StepParts, env: DistEnv, device: torch.device, prec: Precision,
           strategy: str, loader: Any, timer: StepTimer | None = None) -> "StepOnly":
        """The step of ``parts`` (``setup.build_step``'s), as :func:`~flopwise.train.setup.setup`
        arranges it for a run."""
        return cls(cfg=cfg, env=env, timer=timer or StepTimer(device), prec=prec, optimizer=parts.optimizer,
                   strategy=Strategy(strategy, ""), train_model=parts.train_model, train_loader=loader,
                   world=env.world_size, autocast=autocast_factory(device, prec.autocast_dtype),
                   loss_fn=parts.loss_fn, master=parts.master,
                   opt_params=[q for g in parts.optimizer.param_groups for q in g["params"]],
                   clip=grad_clip(cfg), state_model=parts.master.master if parts.master else parts.model,
                   fixed=StepFixed.of(parts.optimizer, prec.scaler, strategy, cfg))


@dataclass
class StepOutcome:
    """A step's values as read on the host."""

    step: int  # 0-based index of the step
    loss: float  # the step's loss over all ranks
    grad_norm: float  # before clipping
    tokens: int = 0  # over all ranks
    lr: float = 0.0
    bad: str = ""  # "" (the update was made), "nonfinite" (it was not) or "collapse" (:func:`settle` decides)
    layer_stats: dict[str, Any] | None = None  # per-parameter gradient norms (and update ratios), when due
    loader_mark: "LoaderMark | None" = None  # where the loader stood after this step
    votes: list[float] = field(default_factory=list)  # the ranks' stop votes, summed (``stopping.stop_votes``)

    @property
    def loader_state(self) -> dict[str, Any] | None:
        """Where the loader stood after this step (taken when first asked: :class:`LoaderMark`)."""
        return self.loader_mark.state() if self.loader_mark is not None else None


class LoaderMark:
    """Where a loader stood after a step, taken only when read: a rollback or a stop's diagnostics
    read it, which few steps do. :meth:`state` takes it while the loader has not moved on (a step
    read at once); :meth:`keep` takes it before the loader hands out the next step's batches (a
    step read one step late). ``batches`` (what the loaders count) tells a state asked too late."""

    def __init__(self, loader: Any):
        self.loader, self.drawn = loader, getattr(loader, "batches", None)
        self._state: dict[str, Any] | None = None

    def state(self) -> dict[str, Any]:
        """The loader's ``state_dict()`` after the step (taken now, unless kept already)."""
        if self._state is None:
            if getattr(self.loader, "batches", None) != self.drawn:
                raise RuntimeError("a step's loader state was asked for after the loader moved on: keep() it "
                                   "before the next step draws its batches")
            self._state = self.loader.state_dict()
        return self._state

    def keep(self) -> None:
        """Take :meth:`state` now: the loader is about to hand out the next step's batches."""
        self.state()


class PendingStep:
    """A step whose values are still on the device: ``[loss, gradient norm, bad, *votes]``.

    Made, the values start to travel to the host without blocking (CUDA: into pinned memory,
    an event behind the copy); :meth:`read` waits for that copy alone -- when the loop reads one
    step late the next step is already queued behind it, so the device stays busy."""

    def __init__(self, step: int, values: torch.Tensor, tokens: int, lr: float, loader: Any,
                 layer_stats: dict[str, Any] | None = None, read: bool = False):
        self.step, self.tokens, self.lr, self.layer_stats = step, tokens, lr, layer_stats
        self.loader_mark = LoaderMark(loader)
        self._values, self._event = values, None
        self._outcome: StepOutcome | None = None
        if values.device.type != "cpu":
            self._values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._values.copy_(values, non_blocking=True)
            self._event = copy_done(values.device)
        if read:
            self.read()

    def read(self) -> StepOutcome:
        """The values on the host (the first call waits for their copy; later ones return it)."""
        if self._outcome is None:
            if self._event is not None:
                self._event.synchronize()
            loss, grad_norm, bad, *votes = self._values.tolist()
            self._outcome = StepOutcome(self.step, loss, grad_norm, self.tokens, self.lr, "nonfinite" if bad else "",
                                        self.layer_stats, self.loader_mark, votes)
        return self._outcome

    def keep_loader_state(self) -> None:
        """Take the loader's state after this step now: the loader is about to move on."""
        self.loader_mark.keep()


def copy_done(device: torch.device) -> Any:
    """An event recorded behind the copies queued so far on ``device``'s stream (the traced dry
    run, on fake tensors, answers with one that has nothing to wait for)."""
    event = torch.cuda.Event()
    event.record()
    return event


def set_rate(optimizer: torch.optim.Optimizer, lr: float, peak_lr: float) -> None:
    """Every group's rate for this step (Muon + AdamW: each group's own peak times the factor)."""
    if isinstance(optimizer, CombinedOptimizer):
        set_lr_factor(optimizer, lr / peak_lr)
    else:
        set_lr(optimizer, lr)


def train_step(run: Run | StepOnly, step: int, accum: int, step_tokens: int, lr: float,
               votes: list[float] | None = None, fixed: StepFixed | None = None) -> PendingStep:
    """Optimizer step ``step`` (0-based) of ``accum`` micro-batches per rank, ``step_tokens`` tokens
    over all ranks, at rate ``lr``; ``votes`` (data parallelism) travel in the step's all-reduce.
    The update is made unless the step is bad -- decided on the device. No host read, except
    where a per-layer statistics step is due or the optimizer cannot skip on the device.
    ``fixed``: what set-up fixed (:class:`StepFixed`; a :class:`StepOnly` holds its own), made
    once by the caller rather than decided again every step."""
    if fixed is None:
        fixed = run.fixed if isinstance(run, StepOnly) else StepFixed.of(run.optimizer, run.prec.scaler,
                                                                          run.strategy.step, run.cfg)
    t, timer, scaler, optimizer = run.cfg.train, run.timer, run.prec.scaler, run.optimizer
    set_rate(optimizer, lr, run.cfg.optim.lr)
    with timer.part("fwd_bwd"), nvtx(t.nvtx, "forward_backward"):
        micro = timer.timed_batches(run.train_loader.next_batch, accum)
        # Each rank divides by its own share of the tokens; DDP/FSDP average over ranks,
        # on this step's last micro-batch (a batch ramp changes their number per step).
        sync = grad_sync(run.train_model, run.strategy.step, accum) if run.strategy.step != "single" else None
        loss = forward_backward(run.train_model, micro, step_tokens // run.world, run.autocast, run.loss_fn,
                                scaler, sync, accum)
    with timer.part("optim"), nvtx(t.nvtx, "optimizer"):
        grad_norm = unscale_and_clip(optimizer, scaler, run.master, run.opt_params, run.clip)
        values = step_values(run.env, loss, grad_norm, scaler is None, votes or [])
    tr = run.cfg.tracking
    stats, before = None, None
    if tr.grad_norms_every > 0 and (step + 1) % tr.grad_norms_every == 0:
        stats = layer_grad_norms(run.state_model)
        if tr.update_ratios:
            before = {n: p.detach().clone() for n, p in run.state_model.named_parameters()}
    pending = PendingStep(step, values, step_tokens, lr, run.train_loader, stats, read=not fixed.on_device)
    with timer.part("optim"), nvtx(t.nvtx, "optimizer"):
        if fixed.on_device and fixed.fp16:
            # The scaler hands the optimizer its found_inf (scaler.step): a non-finite loss made the
            # gradients non-finite in the backward (forward_backward), so that skips this update too.
            apply_update(optimizer, scaler, run.master)
        elif fixed.on_device:
            with skipped_if(optimizer, values[2].to(torch.float32)):
                apply_update(optimizer, scaler, run.master)
        elif not pending.read().bad:  # decided on the host, before the update: one read per step
            apply_update(optimizer, scaler, run.master)
        elif scaler is not None:
            scaler.update()  # closes this step's unscale_ so the next step can unscale again
        if fixed.fp8_gather:  # every weight's amax in one all-reduce, for the next all-gather's fp8 casts
            fp8_scales_for_fsdp(run.train_model)
    if before is not None and stats is not None:
        stats["update_ratios"] = update_ratios(run.state_model, before)
    optimizer.zero_grad(set_to_none=fixed.set_to_none)
    return pending


def forward_backward(
    model: torch.nn.Module,
    micro_batches: Iterable[tuple[torch.Tensor, ...]],
    step_tokens: int,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    scaler: "torch.amp.GradScaler | None" = None,
    sync: Callable[[int], contextlib.AbstractContextManager] | None = None,
    count: int = 0,
) -> torch.Tensor:
    """Accumulate gradients over ``micro_batches``; return the step's mean loss (detached).

    The loss is a mean over *all tokens of the global batch*: each micro-batch contributes
    ``sum of token losses / tokens in the whole step``. With equal-length windows this is the
    same as dividing each micro-batch mean by the number of micro-batches, but it stays
    right when micro-batches carry different numbers of target tokens (masking, packing),
    where averaging micro-batch means would over-weight the short ones.

    ``step_tokens`` is the number of target tokens in the whole step, known in advance
    from the batch geometry, so each backward can be issued as soon as its micro-batch
    is done without holding activations for the others. A micro-batch is ``(x, y)`` or
    ``(x, y, doc_ids)``. The returned loss is the language-model loss only (a model's
    aux loss -- MoE load balance -- is trained on, not reported in it). ``loss_fn`` is
    :func:`make_loss_fn`'s (default: the plain one); ``scaler`` scales fp16 losses (a
    non-finite one's gradients made NaN: :func:`nonfinite_to_nan`, once a step, on the last of
    ``count`` micro-batches, where the gradients are summed over ranks; 0: on each).
    ``sync(i)`` is the context micro-batch ``i`` runs in: under data parallelism it holds
    back the gradient all-reduce until the last micro-batch of the step (``parallel/strategy.py``).
    Under data parallelism ``step_tokens`` is this rank's share: DDP and FSDP average the
    ranks' gradients, which turns the ranks' ``sum / local tokens`` into the global mean.
    """
    loss_fn = loss_fn or make_loss_fn(model)
    total = None
    for i, batch in enumerate(micro_batches):
        x, y = batch[0], batch[1]
        doc_ids = batch[2] if len(batch) > 2 else None  # per-document attention (model.doc_mask)
        with sync(i) if sync is not None else contextlib.nullcontext():
            with autocast():
                s, aux = loss_fn(x, y, doc_ids)
            loss = s / step_tokens
            if aux is not None:
                # MoE: the weighted load-balance (+ z) loss of this micro-batch. Its weight is per
                # micro-batch, so each adds aux * its share of the step's tokens.
                loss = loss + aux * (y.numel() / step_tokens)
            if scaler is not None and scaler.is_enabled() and i + 1 >= count:  # the last (count unknown: each)
                loss = loss * nonfinite_to_nan(s.detach() if total is None else total + s.detach())
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total = s.detach() if total is None else total + s.detach()
    assert total is not None, "a step needs at least one micro-batch"
    return total / step_tokens


def step_values(env: DistEnv, loss: torch.Tensor, grad_norm: torch.Tensor, check_grads: bool,
                votes: list[float]) -> torch.Tensor:
    """``[loss, gradient norm, bad, *votes]`` (float64, on the device) of the step, nothing read.
    Under data parallelism loss and votes are summed over ranks in one all-reduce (the loss
    then averaged: each rank's is over its share of the batch), so a NaN on one rank is a NaN
    on all and every rank takes the same decision; the gradient norm is already global. Bad:
    a loss that is not finite, or gradients (``check_grads``; with fp16 loss scaling an
    overflowing gradient is routine and the scaler skips its update itself)."""
    loss_g, grad_norm = loss.double(), grad_norm.double().to(loss.device)
    votes_t = None
    if votes:
        votes_t = (torch.tensor(votes, dtype=torch.float64).pin_memory().to(loss.device, non_blocking=True)
                   if loss.device.type == "cuda" else torch.tensor(votes, dtype=torch.float64))
    if env.distributed:
        comm = loss.device if env.backend == "nccl" else torch.device("cpu")
        summed = env.sum_tensor(torch.cat([loss_g.reshape(1)] + ([votes_t] if votes_t is not None else [])).to(comm))
        summed = summed.to(loss.device)
        loss_g, votes_t = summed[0] / env.world_size, (summed[1:] if votes_t is not None else None)
    finite = torch.isfinite(loss_g) & torch.isfinite(grad_norm) if check_grads else torch.isfinite(loss_g)
    head = torch.stack([loss_g, grad_norm, (~finite).double()])
    return head if votes_t is None else torch.cat([head, votes_t])


def nonfinite_to_nan(s: torch.Tensor) -> torch.Tensor:
    """1.0 where ``s`` (detached) is finite, NaN where it is not (0-dim, on the device, nothing read).

    Under fp16 loss scaling the step's last micro-batch's loss is multiplied by it (``s``: the
    step's loss sum on this rank) before its backward: the same loss and gradients when the
    loss is finite (times 1.0), NaN gradients when it is not -- which the GradScaler's own
    unscale_ finds, so its step skips the update and its update() lowers the scale, as for any
    overflow, through its public calls alone. Under data parallelism that backward's all-reduce
    carries the NaN to every rank, so all skip alike."""
    return torch.where(torch.isfinite(s), 1.0, float("nan")).to(s.dtype)


def unscale_and_clip(optimizer: torch.optim.Optimizer, scaler, master: MasterWeights | None,
                     params: list[torch.nn.Parameter], clip: float) -> torch.Tensor:
    """The step's gradients made ready for the update: copied to the fp32 master weights
    (bf16-pure), unscaled (fp16), clipped to ``clip``; returns their norm before clipping."""
    if master:
        master.grads_to_master()
    if scaler is not None:
        scaler.unscale_(optimizer)
    return clip_grad_norm(params, clip)


def apply_update(optimizer: torch.optim.Optimizer, scaler, master: MasterWeights | None) -> None:
    """The optimizer step (through the fp16 scaler, which skips an overflowing one), rounded
    back to the bf16 weights under bf16-pure."""
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if master:
        master.master_to_model()


def settle(run: Run, out: StepOutcome, reload: Callable[[Any], dict]) -> bool:
    """The guard's verdict on a step read on the host (in step order, at most one step late):
    True when it was a good step -- its loss counted, a spike logged -- False when it was bad
    (not finite, or the last step of a collapse), which :func:`handle_bad_step` has handled."""
    guard = run.guard
    finite = guard.check(out.loss, out.grad_norm if run.prec.scaler is None else 0.0)
    if finite and not out.bad and not guard.collapsed(out.loss, out.grad_norm):
        return True
    out.bad = "nonfinite" if not finite or out.bad else "collapse"
    handle_bad_step(run, out, reload)
    return False


def handle_bad_step(run: Run, out: StepOutcome, reload: Callable[[Any], dict]) -> None:
    """Apply ``train.nonfinite`` to a bad step (a loss or gradients that are not finite, or the
    last step of a collapse: :meth:`NonFiniteGuard.collapsed`), read after the loop counted it
    and maybe after the next step ran. A non-finite step's update was not made (the device
    skipped it); a collapse's was, and only a rollback undoes it. ``run.progress`` moves to
    where the loop continues: the step's tokens taken back (skip; its update is not made, the
    next step stands as it was made), or back to the last checkpoint (rollback, through
    ``reload``: the data up to and including this step skipped, a next step's work undone with
    the weights). Raises :class:`NonFiniteError`, after writing ``nonfinite-step-N.json``, when
    the policy is ``stop`` or one of its bounds is reached (:meth:`NonFiniteGuard.refusal`)."""
    guard, p, log = run.guard, run.progress, run.log
    collapse = out.bad == "collapse"
    bad_step, last_saved = out.step + 1, p.last_saved
    if collapse:
        what = (f"collapse at step {bad_step}: gradient norm {out.grad_norm:.3g} for {guard.collapse_steps} steps "
                f"in a row (loss {out.loss:.6f}, uniform ln V = {guard.uniform_loss:.6f})")
    else:
        what = f"non-finite loss or gradients at step {bad_step} (loss {out.loss}, grad norm {out.grad_norm})"
    run.sink.write({"step": bad_step, "event": out.bad, "loss": out.loss, "grad_norm": out.grad_norm,
                    "policy": guard.policy})
    checkpoint = last_saved.name if last_saved is not None else None
    refusal = guard.refusal(checkpoint, collapse)
    if refusal:
        if guard.policy != "stop":
            log(f"  event {what}: stopping: {refusal}")
        diag = run.run_dir / f"nonfinite-step-{bad_step:07d}.json"
        if run.env.is_main:
            write_json(diag, {
                "step": bad_step, "event": out.bad, "loss": out.loss, "grad_norm": out.grad_norm, "lr": out.lr,
                "policy": guard.policy, "stopped_because": refusal, "in_a_row": guard.in_a_row,
                "skipped": guard.skipped, "rollbacks": guard.rollbacks, "rollbacks_to": guard.rollbacks_to,
                "loader_after_step": out.loader_state,
                "last_checkpoint": str(last_saved) if last_saved else None,
            }, "the diagnostics of the stop")
        raise NonFiniteError(f"{what}; diagnostics in {diag}; last checkpoint {last_saved}; {refusal}")
    run.meter.pause()
    if guard.policy == "skip":
        guard.record_skip()
        log(f"  event {what}: update skipped ({guard.in_a_row} in a row, {guard.skipped} of at most "
            f"{guard.max_skips} in the run)")
        p.tokens -= out.tokens  # the batch is consumed, nothing learned from it (no tokens counted)
    else:
        # rollback: the weights, optimizer and RNG of the last checkpoint; the data up to this
        # step's end is skipped. The guard keeps its own counts (reload does not touch it): the
        # one being made included.
        assert checkpoint is not None, "refusal() stops a rollback with no checkpoint to go to"
        saved = reload(last_saved)  # weights, optimizer and RNG states
        run.train_loader.load_state_dict(out.loader_state)
        guard.record_rollback(checkpoint)
        log(f"  event {what}: rolled back to {checkpoint}, skipping the data since then ({guard.rollbacks} of at "
            f"most {guard.max_rollbacks} in the run, {guard.rollbacks_to[checkpoint]} of "
            f"{guard.max_rollbacks_per_checkpoint} to this checkpoint)")
        p.step, p.tokens = saved["step"], saved["tokens"]
        if run.master:
            run.master.master_to_model()


def layer_grad_norms(model: torch.nn.Module) -> dict[str, dict[str, float]]:
    """Each parameter's gradient norm (before clipping), in one device-to-host transfer."""
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    norms = torch.stack([_full(g.detach().float().norm()) for _, g in named]).tolist()
    return {"grad_norms": dict(zip((n for n, _ in named), norms))}


def update_ratios(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> dict[str, float]:
    """|w_after - w_before| / |w_before| per parameter: how far this step moved each weight."""
    names, ratios = [], []
    for n, p in model.named_parameters():
        old = before[n].float()
        names.append(n)
        ratios.append(_full((p.detach().float() - old).norm()) / _full(old.norm()).clamp_min(1e-12))
    return dict(zip(names, torch.stack(ratios).tolist()))


def _full(t: torch.Tensor) -> torch.Tensor:
    """A norm over all ranks' shards when ``t`` is an FSDP2 DTensor; ``t`` otherwise."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
