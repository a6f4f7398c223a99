"""One optimizer step, top to bottom, and what happens to a bad one.

:func:`train_step`: the learning rate; forward and backward over the step's micro-batches
(gradient accumulation; under data parallelism the gradients are averaged on the last
one); fp32 master gradients; loss-scale unscaling; clipping; the step's loss and gradient
norm in one device-to-host transfer; the non-finite/collapse guard -- before any update;
optional per-layer statistics; the optimizer step. A bad step is handed to
:func:`handle_bad_step`, which applies ``train.nonfinite`` (stop, skip or rollback).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from flopwise.train.optim import CombinedOptimizer, set_lr, set_lr_factor
from flopwise.train.parallel import clip_grad_norm, grad_sync, grads_set_to_none
from flopwise.train.precision import MasterWeights
from flopwise.train.setup import Run
from flopwise.train.step import forward_backward
from flopwise.train.stopping import NonFiniteError
from flopwise.train.timing import nvtx


@dataclass
class StepOutcome:
    loss: float  # the step's loss over all ranks
    grad_norm: float  # before clipping
    bad: str = ""  # "" (the update was made), "nonfinite" or "collapse" (it was not)
    layer_stats: dict[str, Any] | None = None  # per-parameter gradient norms (and update ratios), when due


def set_rate(optimizer: torch.optim.Optimizer, lr: float, peak_lr: float) -> None:
    """Every group's rate for this step (Muon + AdamW: each group's own peak times the factor)."""
    if isinstance(optimizer, CombinedOptimizer):
        set_lr_factor(optimizer, lr / peak_lr)
    else:
        set_lr(optimizer, lr)


def train_step(run: Run, step: int, accum: int, step_tokens: int, lr: float) -> StepOutcome:
    """Optimizer step ``step`` (0-based) of ``accum`` micro-batches per rank, ``step_tokens`` tokens
    over all ranks, at rate ``lr``. The update is made only when the guard lets it through."""
    t, timer, scaler, optimizer = run.cfg.train, run.timer, run.prec.scaler, run.optimizer
    set_rate(optimizer, lr, run.cfg.optim.lr)
    with timer.part("fwd_bwd"), nvtx(t.nvtx, "forward_backward"):
        micro = timer.timed_batches(run.train_loader.next_batch, accum)
        # Each rank divides by its own share of the tokens; DDP/FSDP average over ranks,
        # on this step's last micro-batch (a batch ramp changes their number per step).
        sync = grad_sync(run.train_model, run.strategy.name, accum) if run.strategy.name != "single" else None
        loss = forward_backward(run.train_model, micro, step_tokens // run.world, run.autocast, run.loss_fn,
                                scaler, sync)
    with timer.part("optim"), nvtx(t.nvtx, "optimizer"):
        grad_norm = unscale_and_clip(optimizer, scaler, run.master, run.opt_params, run.clip)
    loss_f, gnorm_f = global_loss(run.env, loss, grad_norm)  # one transfer per step
    # With fp16 loss scaling an overflowing gradient is routine: the scaler skips that update
    # and lowers its scale, so only the loss decides there. A collapse (gradient norm ~0 for
    # train.collapse_steps steps) is handled as a bad step too, from the same floats.
    finite = run.guard.check(loss_f, gnorm_f if scaler is None else 0.0)
    if not finite or run.guard.collapsed(loss_f, gnorm_f):
        return StepOutcome(loss_f, gnorm_f, "collapse" if finite else "nonfinite")

    tr = run.cfg.tracking
    stats, before = None, None
    if tr.grad_norms_every > 0 and (step + 1) % tr.grad_norms_every == 0:
        stats = layer_grad_norms(run.state_model)
        if tr.update_ratios:
            before = {n: p.detach().clone() for n, p in run.state_model.named_parameters()}
    with timer.part("optim"), nvtx(t.nvtx, "optimizer"):
        apply_update(optimizer, scaler, run.master)
    if before is not None:
        stats["update_ratios"] = update_ratios(run.state_model, before)
    optimizer.zero_grad(set_to_none=grads_set_to_none(run.strategy.name))
    return StepOutcome(loss_f, gnorm_f, "", stats)


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


def global_loss(env, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, float]:
    """The step's loss and gradient norm as floats, in one device-to-host transfer. Under data
    parallelism the loss is the mean of the ranks' (each over its share of the batch), so a
    NaN on one rank is a NaN on all and every rank takes the same non-finite decision; the
    gradient norm is already global."""
    packed = torch.stack([loss.float(), grad_norm.float().to(loss.device)])
    if env.distributed:
        packed = env.sum_tensor(packed.to(loss.device if env.backend == "nccl" else "cpu")) / env.world_size
    loss_f, gnorm_f = packed.tolist()
    return loss_f, gnorm_f


def handle_bad_step(run: Run, out: StepOutcome, lr: float, reload) -> None:
    """Apply ``train.nonfinite`` to a bad step (a loss or gradients that are not finite, or the
    last step of a collapse: :meth:`NonFiniteGuard.collapsed`); its update has not happened.
    ``run.progress`` moves to where the loop continues: past the batch (skip) or back to the
    last checkpoint (rollback, through ``reload``). Raises :class:`NonFiniteError`, after
    writing ``nonfinite-step-N.json``, when the policy is ``stop`` or one of its bounds is
    reached (:meth:`NonFiniteGuard.refusal` says which)."""
    guard, p, log = run.guard, run.progress, run.log
    collapse = out.bad == "collapse"
    bad_step, last_saved = p.step + 1, p.last_saved
    run.optimizer.zero_grad(set_to_none=grads_set_to_none(run.strategy.name))
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
            diag.write_text(json.dumps({
                "step": bad_step, "event": out.bad, "loss": out.loss, "grad_norm": out.grad_norm, "lr": lr,
                "policy": guard.policy, "stopped_because": refusal, "in_a_row": guard.in_a_row,
                "skipped": guard.skipped, "rollbacks": guard.rollbacks, "rollbacks_to": guard.rollbacks_to,
                "loader_after_step": run.train_loader.state_dict(),
                "last_checkpoint": str(last_saved) if last_saved else None,
            }, indent=2, default=str))
        raise NonFiniteError(f"{what}; diagnostics in {diag}; last checkpoint {last_saved}; {refusal}")
    if guard.policy == "skip":
        guard.record_skip()
        log(f"  event {what}: update skipped ({guard.in_a_row} in a row, {guard.skipped} of at most "
            f"{guard.max_skips} in the run)")
        p.step += 1  # the batch is consumed, nothing learned from it (no tokens counted)
    else:
        # rollback: the weights, optimizer and RNG of the last checkpoint; the data since it is
        # skipped. The guard keeps its own counts (reload does not touch it): the one being made included.
        position = run.train_loader.state_dict()
        saved = reload(last_saved)  # weights, optimizer and RNG states
        run.train_loader.load_state_dict(position)
        guard.record_rollback(checkpoint)
        log(f"  event {what}: rolled back to {checkpoint}, skipping the data since then ({guard.rollbacks} of at "
            f"most {guard.max_rollbacks} in the run, {guard.rollbacks_to[checkpoint]} of "
            f"{guard.max_rollbacks_per_checkpoint} to this checkpoint)")
        p.step, p.tokens = saved["step"], saved["tokens"]
    if run.master:
        run.master.master_to_model()
    if run.prec.scaler is not None:
        run.prec.scaler.update()  # closes this step's unscale_ so the next step can unscale again


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
