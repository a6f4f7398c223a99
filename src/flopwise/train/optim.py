"""Optimizers (AdamW, or Muon for hidden matrices + AdamW for the rest) and the step-based schedule.

AdamW (``optim.name=adamw``): decoupled weight decay on matrices (2-D and up) only.

Muon (``optim.name=muon``): the 2-D weight matrices inside the transformer blocks (the
attention and MLP projections) are updated with the orthogonalised Nesterov momentum of
Muon; everything else -- token embedding, position table, LM head, MoE router, norms,
biases and the 3-D stacked MoE expert tensors -- stays on AdamW with its usual groups.
Muon is :class:`Muon`, written here: the algorithm, options (the Newton-Schulz ones grouped
as a :class:`NewtonSchulz`), state (``momentum_buffer``) and group keys of torch's
``torch.optim.Muon`` (a test holds them equal), plus the skip on the device that torch's
lacks (below).

A bad step is skipped on the device, with no host read (``train/train_step.py``): the
optimizer is told through a 0-dim ``found_inf`` tensor, as ``torch.amp.GradScaler`` tells
fused AdamW -- fused AdamW (the default, on CPU and CUDA) leaves parameters, moments and step
count as they were; :class:`Muon` keeps parameters and momentum. :func:`skipped_if` sets it on
every optimizer that steps parameters (ZeRO-1's local one, each of Muon + AdamW);
:func:`skips_on_device` says whether all of them can (a non-fused AdamW cannot: the step then
reads the guard's values before the update).

Muon learning rate: ``optim.muon_lr`` (default 0.02, as in Keller Jordan's write-up),
scaled per matrix by ``sqrt(max(1, rows / cols))`` for a (rows=out, cols=in) weight --
torch's ``adjust_lr_fn="original"``: the Newton-Schulz output has singular values ~1
whatever the shape, so a matrix with more outputs than inputs gets a proportionally
larger step to keep the per-output update comparable. Muon's weight decay
(``optim.muon_weight_decay``) is decoupled like AdamW's: ``p *= 1 - lr * wd``.

Muon under data parallelism (DDP, and DDP inside a DiLoCo worker group): every rank holds the
same averaged gradients, so each would otherwise run the same Newton-Schulz iterations on every
matrix -- 5 x 3 matmuls per matrix per step, most of the optimizer's cost, N times over.
Given the group (``build_optimizer``'s ``group``), :class:`Muon` deals the matrices round-robin
over its ranks, each orthogonalises its own and the results are all-gathered (as modded-nanogpt
and Moonlight do), so every rank applies the same bits a one-rank Muon would. The momentum
stays whole on every rank, so the state dict is the same at any world size.

Both kinds of groups carry ``base_lr`` (their peak rate: ``muon_lr`` or ``lr``), so a
schedule is applied with one multiplier, :func:`set_lr_factor`; a Muon run returns a
:class:`CombinedOptimizer` with the usual ``step`` / ``zero_grad`` / ``state_dict`` /
``load_state_dict`` / ``param_groups``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from flopwise.config import OptimConfig
from flopwise.parallel.distributed import all_gather_into

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

# Keller Jordan's quintic Newton-Schulz coefficients (steepest slope at 0; singular values
# land in roughly [0.7, 1.2] after 5 steps rather than exactly 1, which trains as well).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
NS_DTYPE = torch.bfloat16  # what Newton-Schulz computes in (bf16: see newton_schulz)

# Wrapper modules that insert a component into parameter names (compile, DDP, FSDP1,
# activation checkpointing); the Muon split looks through them.
_WRAPPER_PARTS = frozenset({"_orig_mod", "module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


# ----------------------------------------------------------------------------- groups


def _decay_groups(params: Iterable[torch.Tensor], weight_decay: float) -> list[dict]:
    decay: list[torch.Tensor] = []
    no_decay: list[torch.Tensor] = []
    for p in params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay for matrices (linear and embedding weights); none for norms and biases.

    Tied parameters appear once: ``named_parameters`` de-duplicates shared tensors.
    """
    return _decay_groups((p for _, p in model.named_parameters()), weight_decay)


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """A 2-D hidden matrix: inside a block's attention or MLP, not the MoE router.

    Embeddings and the head are left to AdamW (their rows are looked up or scored one
    token at a time; Muon's argument is for maps between hidden spaces), as are norms,
    biases and 3-D expert stacks (``torch.optim.Muon`` takes 2-D tensors only)."""
    parts = [part for part in name.split(".") if part not in _WRAPPER_PARTS]
    return (p.dim() == 2 and len(parts) > 2 and parts[0] == "layers"
            and parts[2] in ("attn", "mlp") and "router" not in parts)


def muon_split(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[tuple[str, torch.Tensor]]]:
    """(parameters for Muon, named parameters for AdamW), trainable ones only, each once."""
    muon: list[torch.Tensor] = []
    adamw: list[tuple[str, torch.Tensor]] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if is_muon_param(name, p):
            muon.append(p)
        else:
            adamw.append((name, p))
    return muon, adamw


# ----------------------------------------------------------------------------- Muon


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = NS_EPS, dtype: torch.dtype = NS_DTYPE,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximately orthogonalise ``g`` (..., m, n): U S V^T -> U S' V^T with S' ~ 1.

    The quintic iteration X <- a X + (b A + c A^2) X, A = X X^T, after scaling X to
    Frobenius norm 1 (so the spectral norm is <= 1). It runs on the wide orientation
    (m <= n) so that A is the small Gram matrix, in ``dtype`` (bf16: the iteration is
    robust to its rounding, and bf16 matmuls are the fast ones on accelerators).
    Leading dimensions are a batch. Returns ``out_dtype``, by default ``g``'s."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp_min(eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    if tall:
        x = x.mT
    return x.to(g.dtype if out_dtype is None else out_dtype)


def muon_lr_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """``sqrt(max(1, rows / cols))`` for a (rows, cols) = (out, in) weight; torch's "original"."""
    rows, cols = shape[-2], shape[-1]
    return math.sqrt(max(1.0, rows / cols))


@dataclass(frozen=True)
class NewtonSchulz:
    """The settings of :func:`newton_schulz`: the quintic's coefficients, its number of steps,
    and the floor of the norm it first divides by. The defaults are Keller Jordan's."""

    coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    steps: int = NS_STEPS
    eps: float = NS_EPS


class Muon(torch.optim.Optimizer):
    """Muon for 2-D parameters.

    Per step: buf <- mu buf + (1 - mu) g; update = (1 - mu) g + mu buf with Nesterov
    (else buf); O = newton_schulz(update); p <- p (1 - lr wd) - lr * muon_lr_scale(p) * O.
    The same algorithm, group keys and state as ``torch.optim.Muon`` (with
    ``adjust_lr_fn="original"``), so a checkpoint loads into either, and the same options but
    one: torch's ``ns_coefficients``, ``ns_steps`` and ``eps`` are given together as ``ns``, a
    :class:`NewtonSchulz` (the group keys keep torch's names). With ``found_inf`` set (a 0-dim
    tensor, non-zero on a bad step) each parameter and its momentum keep their old values
    where it is non-zero -- chosen on the device, the same numbers otherwise.

    ``group``: a process group whose ranks all hold these parameters and the same gradients
    (DDP's, a DiLoCo worker group's). With more than one rank its Newton-Schulz work is split
    over them (:meth:`_split_step`): each rank orthogonalises 1/N of the matrices and gets the
    others' results by all-gather, making bitwise the update of one rank."""

    def __init__(self, params, lr: float = 0.02, weight_decay: float = 0.0, momentum: float = 0.95,
                 nesterov: bool = True, ns: NewtonSchulz = NewtonSchulz(), adjust_lr_fn: str | None = "original",
                 group: dist.ProcessGroup | None = None):
        if lr < 0 or weight_decay < 0 or momentum < 0:
            raise ValueError("Muon lr, weight_decay and momentum must be >= 0")
        if adjust_lr_fn not in (None, "original"):
            raise ValueError(f"flopwise's Muon supports adjust_lr_fn='original' only, got {adjust_lr_fn!r}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns.coefficients), eps=ns.eps, ns_steps=ns.steps,
                        adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)
        for g in self.param_groups:
            for p in g["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon takes 2-D parameters only, got shape {tuple(p.shape)}")
        # Not a group key (torch's Muon has none such, and a checkpoint must load at any world size).
        self.group = group
        self.ranks = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None):  # type: ignore[override]  # vs torch overloads
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf: torch.Tensor | None = getattr(self, "found_inf", None)
        keep = None if found_inf is None else found_inf != 0
        if self.ranks > 1:
            self._split_step(keep)
            return loss
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                buf = self._momentum(p)
                if keep is None:  # nothing needs the old values: buffer and weights updated in place
                    self._moved(p, self._orthogonalised(p, buf.lerp_(g, 1 - mu), group), group, in_place=True)
                else:  # one parameter's temporaries at a time; NaN in the unchosen side goes nowhere
                    new_buf = buf.lerp(g, 1 - mu)
                    new_p = self._moved(p, self._orthogonalised(p, new_buf, group), group, in_place=False)
                    torch.where(keep, buf, new_buf, out=buf)  # written where read: elementwise, no copy back
                    torch.where(keep, p, new_p, out=p)
        return loss

    def _momentum(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s momentum buffer (zeros like its gradient at its first step)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            assert p.grad is not None  # the step's parameters have a gradient
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    @staticmethod
    def _orthogonalised(p: torch.Tensor, buf: torch.Tensor, group: dict,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Newton-Schulz of ``p``'s (Nesterov) update from its new momentum ``buf``. Calls the
        module's :func:`newton_schulz` by name (a test counts the calls)."""
        assert p.grad is not None  # step() passes parameters with a gradient only
        update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        return newton_schulz(update, group["ns_steps"], group["ns_coefficients"], group["eps"], out_dtype=out_dtype)

    @staticmethod
    def _moved(p: torch.Tensor, o: torch.Tensor, group: dict, in_place: bool) -> torch.Tensor:
        """``p``'s new weights -- decayed, then moved by the orthogonalised update ``o`` -- into
        ``p`` itself (``in_place``) or a new tensor."""
        lr, wd = group["lr"], group["weight_decay"]
        return (p.mul_ if in_place else p.mul)(1 - lr * wd).add_(o, alpha=-lr * muon_lr_scale(p.shape))

    # ------------------------------------------------------------------ split over the ranks

    def _split_step(self, keep: torch.Tensor | None) -> None:
        """The step with its Newton-Schulz work split over the ``group``'s N ranks.

        Every rank updates every momentum buffer (cheap, elementwise; the state stays whole on
        each rank, as a one-rank run's, so checkpoints and resumes are unchanged). The matrices,
        largest first (an order every rank agrees on: the same groups and shapes; a stable sort),
        are dealt round-robin in rounds of N -- matrix i of the order to rank i mod N. Each rank
        orthogonalises its matrix of a round; the round's results are all-gathered, each padded
        to the round's largest (the sort keeps that padding small), and every rank applies all N
        of them. A round's gather is in flight while the next round's Newton-Schulz runs; at most
        two rounds' buffers are alive. On a bad step (``keep``) the momentum stays and so do the
        weights, whatever the gathered results hold (NaN included), as in a one-rank step."""
        work = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        for p, g in work:
            buf = self._momentum(p)
            if keep is None:
                buf.lerp_(p.grad, 1 - g["momentum"])
            else:  # a good step: the new buffer, the bits a one-rank step makes from it
                torch.where(keep, buf, buf.lerp(p.grad, 1 - g["momentum"]), out=buf)
        order = sorted(work, key=lambda w: -w[0].numel())
        pending: _Round | None = None
        for start in range(0, len(order), self.ranks):
            launched = self._launch(order[start:start + self.ranks])
            if pending is not None:
                self._apply(pending, keep)
            pending = launched
        if pending is not None:
            self._apply(pending, keep)

    def _launch(self, round_: list[tuple[torch.Tensor, dict]]) -> _Round:
        """This rank's matrix of ``round_`` orthogonalised (a rank past its end has none and sends
        padding) and the round's all-gather started."""
        size = max(p.numel() for p, _ in round_)
        wire = _wire_dtype([p.dtype for p, _ in round_])
        device = round_[0][0].device
        gathered = torch.empty(self.ranks * size, dtype=wire, device=device)
        sent = torch.empty(size, dtype=wire, device=device)
        if self.rank < len(round_):
            p, g = round_[self.rank]
            o = self._orthogonalised(p, self.state[p]["momentum_buffer"], g,
                                     out_dtype=wire if wire == NS_DTYPE else p.dtype)
            sent[:p.numel()].view(p.shape).copy_(o)
        return _Round(round_, gathered, sent, all_gather_into(gathered, sent, self.group, async_op=True))

    def _apply(self, r: _Round, keep: torch.Tensor | None) -> None:
        """Every matrix of a launched round moved by its owner's result, once the gather is done."""
        r.work.wait()
        size = r.sent.numel()
        for j, (p, g) in enumerate(r.matrices):
            o = r.gathered[j * size:j * size + p.numel()].view(p.shape)  # the owner's bits, exactly
            if o.dtype != NS_DTYPE:  # float32 on the wire (fp16 weights): back to the dtype one rank adds
                o = o.to(p.dtype)  # (fp16's add rounds alpha to fp16; bf16 into float32 adds as float32 would)
            if keep is None:
                self._moved(p, o, g, in_place=True)
            else:
                torch.where(keep, p, self._moved(p, o, g, in_place=False), out=p)


@dataclass
class _Round:
    """A round of a split step in flight: its matrices (each with its group), the all-gather's
    output, this rank's input (held until the gather is done with it) and the gather's work."""

    matrices: list[tuple[torch.Tensor, dict]]
    gathered: torch.Tensor
    sent: torch.Tensor
    work: Any


def _wire_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    """What a round's Newton-Schulz results travel in: its bf16 (half float32's bytes) when every
    matrix's own dtype holds each bf16 value exactly -- a float32 result is a bf16 one widened --,
    else float32, which holds any of them exactly. Nothing is rounded that one rank would not round."""
    return NS_DTYPE if all(d in (torch.float32, torch.float64, torch.bfloat16) for d in dtypes) else torch.float32


def muon_class() -> type[Muon]:
    """The Muon the runs use: :class:`Muon` (torch's has no skip on the device)."""
    return Muon


def make_muon(params: list[torch.Tensor], cfg: OptimConfig, cls: Callable[..., torch.optim.Optimizer] | None = None,
              group: dist.ProcessGroup | None = None) -> torch.optim.Optimizer:
    """Muon over ``params`` from the config (Nesterov, 5 Newton-Schulz steps, "original" scaling);
    its Newton-Schulz work split over ``group``'s ranks when it has more than one (:class:`Muon`)."""
    cls = cls or muon_class()
    split: dict[str, Any] = {"group": group} if group is not None else {}  # torch's Muon takes no group
    opt = cls(params, lr=cfg.muon_lr, weight_decay=cfg.muon_weight_decay, momentum=cfg.muon_momentum,
              nesterov=True, adjust_lr_fn="original", **split)
    _keep_base_lr(opt, cfg.muon_lr)
    return opt


# ----------------------------------------------------------------------------- the optimizer


class CombinedOptimizer:
    """Several optimizers over disjoint parameters, driven as one (Muon + AdamW).

    ``param_groups`` is the concatenation of the inner optimizers' groups (the same dicts,
    so setting ``lr`` on them takes effect); the state dict holds each inner state dict
    under its name. Duck-typed like ``torch.optim.Optimizer`` for what the training loop
    and ``torch.amp.GradScaler`` use (``param_groups``, ``step``, ``zero_grad``)."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        if not optimizers:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        self.optimizers = dict(optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    @property
    def state(self) -> dict:
        """Per-parameter state of all inner optimizers (a merged, read-only copy)."""
        merged: dict = {}
        for opt in self.optimizers.values():
            merged.update(opt.state)
        return merged

    def step(self, closure: Callable[[], torch.Tensor] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # once: each inner step would otherwise re-run forward/backward
        for opt in self.optimizers.values():
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": {name: opt.state_dict() for name, opt in self.optimizers.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("optimizers") if isinstance(state_dict, dict) else None
        if not isinstance(saved, dict) or set(saved) != set(self.optimizers):
            have = sorted(saved) if isinstance(saved, dict) else "a single optimizer's state"
            raise ValueError(f"optimizer state holds {have}, this run uses {sorted(self.optimizers)} "
                             "(was optim.name changed since the checkpoint?)")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(saved[name])

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={type(opt).__name__}" for name, opt in self.optimizers.items())
        return f"CombinedOptimizer({inner})"


def _keep_base_lr(opt: torch.optim.Optimizer, base_lr: float) -> None:
    """Record each group's peak rate as ``base_lr``, and restore it after ``load_state_dict``.

    Loading replaces the groups by the saved ones; the configured rate wins over the
    saved one (as the schedule always did: the rate is recomputed from the config each
    step), and a checkpoint written before ``base_lr`` existed still loads."""
    for g in opt.param_groups:
        g["base_lr"] = base_lr

    def restore(optimizer: torch.optim.Optimizer) -> None:
        for g in optimizer.param_groups:
            g["base_lr"] = base_lr

    opt.register_load_state_dict_post_hook(restore)


def _adamw(groups: list[dict], cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; the fused kernel by default, on CUDA and CPU alike (one launch for all parameters,
    and the bad-step skip on the device: :func:`skipped_if`)."""
    fused = device.type in ("cuda", "cpu") if cfg.fused == "auto" else cfg.fused == "true"
    kwargs = {"fused": True} if fused else {"foreach": device.type == "cuda"}
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kwargs)
    _keep_base_lr(opt, cfg.lr)
    return opt


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, device: torch.device,
                    group: dist.ProcessGroup | None = None) -> torch.optim.AdamW | CombinedOptimizer:
    """AdamW (``cfg.name == "adamw"``), or Muon + AdamW as one :class:`CombinedOptimizer`.
    ``group``: the ranks that hold the same parameters and gradients (DDP's; None: this
    process alone), over which Muon splits its Newton-Schulz work."""
    name = getattr(cfg, "name", "adamw")
    if name == "adamw":
        return _adamw(param_groups(model, cfg.weight_decay), cfg, device)
    if name != "muon":
        raise ValueError(f"optim.name {name!r}: choose adamw or muon")
    hidden, rest = muon_split(model)
    optimizers: dict[str, torch.optim.Optimizer] = {}
    if hidden:
        optimizers["muon"] = make_muon(hidden, cfg, group=group)
    optimizers["adamw"] = _adamw(_decay_groups((p for _, p in rest), cfg.weight_decay), cfg, device)
    return CombinedOptimizer(optimizers)


def describe_optimizer(optimizer) -> str:
    """One line for the run log: which optimizer takes how many parameters at which peak rate."""
    parts = []
    inner = optimizer.optimizers if isinstance(optimizer, CombinedOptimizer) else {"adamw": optimizer}
    for opt in inner.values():
        n = sum(p.numel() for g in opt.param_groups for p in g["params"])
        lr = opt.param_groups[0].get("base_lr", opt.defaults.get("lr"))
        extra = ""
        if "momentum" in opt.defaults and "nesterov" in opt.defaults:
            ranks = getattr(opt, "ranks", 1)
            split = f"; Newton-Schulz split over {ranks} ranks, results all-gathered" if ranks > 1 else ""
            extra = (f" (momentum {opt.defaults['momentum']:g}{', Nesterov' if opt.defaults['nesterov'] else ''}, "
                     f"{opt.defaults['ns_steps']} Newton-Schulz steps, lr x sqrt(max(1, out/in)){split})")
        parts.append(f"{type(opt).__name__} lr {lr:g}{extra} for {n:,} parameters")
    return " · ".join(parts)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group to ``lr`` (plain AdamW). A Muon run has two peak rates: use :func:`set_lr_factor`."""
    if isinstance(optimizer, CombinedOptimizer):
        raise TypeError("set_lr would give Muon and AdamW groups the same rate; use set_lr_factor")
    for group in optimizer.param_groups:
        group["lr"] = lr


def set_lr_factor(optimizer, factor: float) -> None:
    """Every group's ``lr`` to its own ``base_lr * factor`` (the schedule's multiplier)."""
    for group in optimizer.param_groups:
        if "base_lr" not in group:
            raise KeyError("a parameter group has no base_lr: build the optimizer with build_optimizer")
        group["lr"] = group["base_lr"] * factor


# ----------------------------------------------------------------------------- the skip on the device


def _leaves(optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers that step parameters: each of a :class:`CombinedOptimizer`'s, a
    ``ZeroRedundancyOptimizer``'s local one (``.optim``), or ``optimizer`` itself."""
    inner = list(optimizer.optimizers.values()) if isinstance(optimizer, CombinedOptimizer) else [optimizer]
    return [cast("ZeroRedundancyOptimizer", o).optim if type(o).__name__ == "ZeroRedundancyOptimizer" else o
            for o in inner]


def skips_on_device(optimizer) -> bool:
    """Whether every optimizer under ``optimizer`` skips a step given ``found_inf`` (fused AdamW,
    :class:`Muon`), so the step needs no host read to decide."""
    return all(isinstance(o, Muon) or (o.defaults.get("fused") and getattr(o, "_step_supports_amp_scaling", False))
               for o in _leaves(optimizer))


@contextlib.contextmanager
def skipped_if(optimizer, bad: torch.Tensor) -> Iterator[None]:
    """Within it, ``optimizer.step()`` leaves everything as it was where ``bad`` (a 0-dim float
    tensor on the parameters' device, 1.0 on a bad step) is non-zero: decided on the device,
    no host read. Needs :func:`skips_on_device`."""
    leaves = _leaves(optimizer)
    for o in leaves:
        o.found_inf = bad  # type: ignore[attr-defined]  # read by fused AdamW's and Muon's step
    try:
        yield
    finally:
        for o in leaves:
            del o.found_inf  # type: ignore[attr-defined]
