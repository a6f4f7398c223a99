"""The language-model objective: token cross-entropy, summed, in float32, and the ways to compute it.

At the model layer because both sides use it: training (``train/train_step.py``) and evaluation
(``evaluate/loss.py``, which the trainer calls for its validation loss) -- so ``evaluate``
needs nothing from ``train``.

- :func:`loss_sum`: logits in, the float32 sum of token losses out; the reference.
- :func:`linear_cross_entropy`: the LM head and the loss together, without materialising the
  (N, V) logits. The plain path -- ``F.linear`` to (N, V) logits, ``.float()``,
  ``F.cross_entropy`` -- holds the logits in the compute dtype, their float32 copy and the
  saved float32 log-softmax, and its backward adds two more (N, V) float32 tensors: at N = 16k
  tokens and V = 49k that is ~3 GiB per (N, V) float32 tensor, far more than the rest of a
  small model's activations. ``chunked`` (:func:`chunked_cross_entropy`, pure PyTorch, any
  device) sends the rows through in chunks of ``chunk_tokens``, so only one chunk's (C, V)
  logits exist at a time and nothing of size N x V is saved for backward; ``fused`` is
  Liger-Kernel's Triton kernel, CUDA only, used by ``auto`` where it is installed
  (:func:`fused_linear_cross_entropy_available`); ``plain`` is the reference. All return the
  *sum* of the token losses as a 0-d float32 tensor (the caller divides).
- :func:`make_loss_fn`: ``fn(x, y, doc_ids)`` for a (wrapped) model with one of those, compiled
  or not -- what a training step calls per micro-batch.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from flopwise.config import ConfigError, Loss, ModelConfig, TrainConfig
from flopwise.model.attention import doc_spans


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Sum of token cross-entropies, computed in float32 (logits may be bf16 under autocast)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
        reduction="sum", ignore_index=ignore_index,
    )


IMPLS = ("auto", "chunked", "plain", "fused")

# Autocast only casts floating tensors of these dtypes (float64 passes through untouched).
_AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError, ValueError):  # a device type autocast does not know
        return False


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast disabled for ``device_type``: inside the Function every cast is explicit."""
    try:
        return torch.autocast(device_type, enabled=False)
    except (RuntimeError, TypeError, ValueError):
        return contextlib.nullcontext()


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` multiplies in at this call site: the autocast
    dtype when autocast is on for hidden's device type, else the inputs' own (equal) dtype."""
    dev = hidden.device.type
    if _autocast_enabled(dev) and hidden.dtype in _AUTOCAST_ELIGIBLE and weight.dtype in _AUTOCAST_ELIGIBLE:
        return torch.get_autocast_dtype(dev)
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype "
                        "outside autocast, as for F.linear")
    return hidden.dtype


def _softmax_minus_onehot_(e: Tensor, denom: Tensor | None, targets: Tensor, row_scale: Tensor) -> Tensor:
    """In place: e = exp(z - shift) (C, V) float32 -> row_scale * (softmax(z) - onehot(targets)).

    ``denom`` (C, 1) is sum(exp(z - shift)) per row (None: shift was the logsumexp, rows
    already sum to 1); ``row_scale`` (C,) float32 is 0 on ignored rows (whose ``targets``
    point at any valid class), so those rows come out 0."""
    if denom is not None:
        e.div_(denom)  # (C, V) softmax
    e.scatter_add_(1, targets.unsqueeze(1), e.new_full((e.size(0), 1), -1.0))  # - onehot
    return e.mul_(row_scale.unsqueeze(1))


class _ChunkedLinearCE(torch.autograd.Function):
    """sum_i CE(hidden_i @ weight.T, targets_i), C rows at a time (see :func:`chunked_cross_entropy`)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, ignore_index: int,
                cdt: torch.dtype, grads_in_forward: bool) -> Tensor:
        # hidden (N, D), weight (V, D), targets (N,) int64; cdt: the matmul dtype.
        N, D = hidden.shape
        V = weight.size(0)
        ctx.cdt, ctx.chunk, ctx.ignore_index = cdt, chunk, ignore_index
        ctx.grads_in_forward = grads_in_forward
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.no_grad(), _autocast_off(hidden.device.type):
            valid = targets != ignore_index  # (N,) bool
            safe = torch.where(valid, targets, 0)  # (N,) ignored rows point at class 0 (scaled to 0 later)
            w = weight.to(cdt)  # (V, D); no copy unless autocast casts it
            losses = torch.empty(N, dtype=torch.float32, device=hidden.device)  # (N,)
            lse = torch.empty(N, dtype=torch.float32, device=hidden.device)  # (N,)
            bufs = _ChunkBuffers(min(chunk, N), V, D, cdt, hidden.device, grads_in_forward and need_w)
            if grads_in_forward:
                grad_h = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_h else None
                grad_w = torch.zeros(V, D, dtype=torch.float32, device=hidden.device) if need_w else None  # (V, D)
                row_scale = valid.float()  # (N,) d(sum)/d(row loss): 1, or 0 when ignored
            for s in range(0, N, chunk):
                e_ = min(s + chunk, N)
                h = hidden[s:e_].to(cdt)  # (C, D)
                z = bufs.logits(h, w)  # (C, V) float32
                tz = z.gather(1, safe[s:e_].unsqueeze(1))  # (C, 1) target logits
                m = z.amax(dim=1, keepdim=True)  # (C, 1)
                z.sub_(m).exp_()  # (C, V) exp(z - m); faster than logsumexp on CPU and reused for the softmax
                denom = z.sum(dim=1, keepdim=True)  # (C, 1)
                row_lse = m + denom.log()  # (C, 1)
                lse[s:e_] = row_lse.squeeze(1)
                losses[s:e_] = torch.where(valid[s:e_], (row_lse - tz).squeeze(1), 0.0)
                if grads_in_forward:
                    g = _softmax_minus_onehot_(z, denom, safe[s:e_], row_scale[s:e_])  # (C, V) float32
                    bufs.project(g, h, w, grad_h, grad_w, s, e_)
            del bufs, w  # the chunk's working memory goes before anything else is allocated
            loss = losses.sum()  # () float32
        if grads_in_forward:
            # Only the gradients are kept; hidden and weight are not saved.
            ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        else:
            ctx.save_for_backward(hidden, weight, targets, lse)
        return loss

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.grads_in_forward:
            grad_h, grad_w = ctx.saved_tensors
            # In place on our own tensors (no second copy of N x D + V x D); a second backward
            # through the same graph then fails the saved-tensor version check instead of
            # silently scaling twice.
            if grad_h is not None:
                grad_h.mul_(grad_out)
            if grad_w is not None:
                grad_w.mul_(grad_out)
            return grad_h, grad_w, None, None, None, None, None
        hidden, weight, targets, lse = ctx.saved_tensors
        N, D = hidden.shape
        V = weight.size(0)
        cdt, chunk = ctx.cdt, ctx.chunk
        with torch.no_grad(), _autocast_off(hidden.device.type):
            valid = targets != ctx.ignore_index  # (N,)
            safe = torch.where(valid, targets, 0)  # (N,)
            row_scale = torch.where(valid, grad_out.float(), 0.0)  # (N,) d(loss)/d(row loss)
            w = weight.to(cdt)  # (V, D)
            grad_h = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_h else None  # (N, D)
            grad_w = torch.zeros(V, D, dtype=torch.float32, device=hidden.device) if need_w else None  # (V, D)
            bufs = _ChunkBuffers(min(chunk, N), V, D, cdt, hidden.device, need_w)
            for s in range(0, N, chunk):
                e_ = min(s + chunk, N)
                h = hidden[s:e_].to(cdt)  # (C, D)
                z = bufs.logits(h, w)  # (C, V) float32, the forward's logits again
                row_lse = lse[s:e_].unsqueeze(1)  # (C, 1)
                z.sub_(row_lse).exp_()  # (C, V) softmax: exp(z - lse), so the denominator is 1
                g = _softmax_minus_onehot_(z, None, safe[s:e_], row_scale[s:e_])  # (C, V)
                bufs.project(g, h, w, grad_h, grad_w, s, e_)
            del bufs, w
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)  # no copy for a float32 weight
        return grad_h, grad_w, None, None, None, None, None


class _ChunkBuffers:
    """One chunk's working memory, allocated once per pass and reused by every chunk.

    Reuse matters on CPU, where a freed (C, V) block goes back to the OS and the next one
    page-faults in again (a cost that grows with the bytes); CUDA's caching allocator
    would reuse it anyway. Size: C x V x 4 bytes, plus C x V x 2 and V x D x 2 for a 16-bit compute
    dtype (the matmul output, and each chunk's weight-gradient product before it is
    added to the float32 accumulator). With float32 weights under autocast, the pass also
    holds the weight cast to the compute dtype (V x D x 2), as autocast's F.linear does."""

    def __init__(self, rows: int, V: int, D: int, cdt: torch.dtype, device: torch.device, need_w: bool):
        self.cdt = cdt
        self.z = torch.empty(rows, V, dtype=torch.float32, device=device)  # (C, V) float32
        low = cdt != torch.float32
        self.low = torch.empty(rows, V, dtype=cdt, device=device) if low else None  # (C, V) cdt
        self.gw = torch.empty(V, D, dtype=cdt, device=device) if low and need_w else None  # (V, D) cdt

    def logits(self, h: Tensor, w: Tensor) -> Tensor:
        """h (C, D), w (V, D), both cdt -> (C, V) float32 logits, rounded through cdt like F.linear."""
        C = h.size(0)
        z = self.z[:C]
        if self.low is None:
            return torch.mm(h, w.t(), out=z)
        low = torch.mm(h, w.t(), out=self.low[:C])  # (C, V) cdt, as autocast's F.linear would output
        return z.copy_(low)

    def project(self, g: Tensor, h: Tensor, w: Tensor, grad_h: Tensor | None, grad_w: Tensor | None,
                s: int, e: int) -> None:
        """Accumulate one chunk's d(logits) g (C, V) float32 into grad_h[s:e] (C, D) and grad_w (V, D)."""
        C = g.size(0)
        if self.low is not None:
            g = self.low[:C].copy_(g)  # (C, V) cdt: the matmuls run in the compute dtype, as autograd's would
        if grad_h is not None:
            if grad_h.dtype == self.cdt:
                torch.mm(g, w, out=grad_h[s:e])  # (C, D)
            else:
                grad_h[s:e] = g @ w  # (C, D) cdt, cast to hidden's dtype
        if grad_w is not None:
            if self.gw is None:
                grad_w.addmm_(g.t(), h)  # (V, D) float32 += (V, C) @ (C, D)
            else:
                grad_w.add_(torch.mm(g.t(), h, out=self.gw))  # (V, D) cdt product, float32 sum over chunks


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int = 4096,
                          ignore_index: int = -100, *, grads_in_forward: bool = False) -> Tensor:
    """Sum over tokens of CE(hidden @ weight.T, targets), float32, without the full (N, V) logits.

    hidden (N, D) or (..., D), any float dtype; weight (V, D) (may be the tied embedding:
    its gradient adds to the embedding's); targets (N,) or (...,) int64. Under autocast the
    matmuls run in the autocast dtype exactly where ``F.linear`` would; logsumexp, softmax
    and the weight-gradient accumulator are float32. Rows whose target is ``ignore_index``
    contribute 0 loss and 0 gradient. Returns a 0-d float32 tensor (the SUM; the caller
    divides). Call it inside the same autocast context as the model's forward.

    Backward *recomputes* each chunk's logits (default). Forward saves hidden (N, D),
    weight (a reference) and the per-row logsumexp (N floats); backward redoes one
    (C, D) x (D, V) matmul per chunk, forms softmax - onehot in place and accumulates
    grad_hidden (N, D) and a float32 grad_weight (V, D). Cost: 4 head matmuls instead of 3.

    ``grads_in_forward=True`` is the "forward-backward fused" variant (Liger's): both
    gradients are formed in the forward (3 matmuls) and held until backward, which only
    scales them by the incoming gradient. Its peak inside one loss forward+backward is the
    same (hidden + grad_hidden + float32 grad_weight + one chunk), but it holds
    grad_hidden + a float32 (V, D) grad_weight -- 4*V*D bytes, 113 MB at 49152 x 576,
    2.1 GB at 128256 x 4096 -- from the loss forward until its backward, instead of
    hidden alone. Anything allocated in between (other micro-batches' forwards in a
    pipelined schedule, a second loss head, an evaluation forward under grad mode) stacks
    on top, and gradients are computed even when no backward ever comes. Recompute is
    never higher and is lower in all of those cases, so it is the default. Where backward
    follows at once (``train/train_step.py``) the peaks are equal and grads-in-forward is faster
    (``benchmarks/chunked_ce.py``; figures in docs/benchmarks.md#chunked-cross-entropy).
    It is only used when grad mode is on.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if weight.dim() != 2 or hidden.size(-1) != weight.size(1):
        raise ValueError(f"hidden (..., D) and weight (V, D) do not match: {tuple(hidden.shape)} vs "
                         f"{tuple(weight.shape)}")
    hidden = hidden.reshape(-1, hidden.size(-1))  # (N, D)
    targets = targets.reshape(-1)  # (N,)
    if targets.numel() != hidden.size(0):
        raise ValueError(f"{targets.numel()} targets for {hidden.size(0)} rows of hidden")
    cdt = _compute_dtype(hidden, weight)
    grads_in_forward = grads_in_forward and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _ChunkedLinearCE.apply(hidden, weight, targets.long(), chunk_tokens, ignore_index, cdt, grads_in_forward)


def plain_linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """The reference: full (N, V) logits by ``F.linear`` (autocast applies), float32 CE summed."""
    logits = F.linear(hidden.reshape(-1, hidden.size(-1)), weight)  # (N, V)
    return F.cross_entropy(logits.float(), targets.reshape(-1), reduction="sum", ignore_index=ignore_index)


# --------------------------------------------------------------------------- fused (Liger-Kernel)

@functools.lru_cache(maxsize=None)
def _liger_flce():
    """Liger-Kernel's functional fused linear cross-entropy, or None when it cannot be imported."""
    try:
        # lazy: Liger-Kernel (and triton) are optional, CUDA only
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception:  # not installed, or Triton / the CUDA toolchain missing: any failure means "unavailable"
        return None
    return liger_fused_linear_cross_entropy


def fused_linear_cross_entropy_available(device: str | torch.device) -> bool:
    """Whether ``impl="fused"`` can run on ``device``: CUDA, and Liger-Kernel importable."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and _liger_flce() is not None


def _fused_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
    """Liger's Triton kernel (grads in forward, like ``grads_in_forward=True``); sum, float32.

    Called by keyword: the positional order of Liger's Function changed between releases,
    the functional wrapper's keywords did not. Liger handles autocast itself."""
    fn = _liger_flce()
    if fn is None:
        raise RuntimeError("impl='fused' needs Liger-Kernel (pip install liger-kernel) on a CUDA device")
    params = inspect.signature(fn).parameters
    kwargs = {"ignore_index": ignore_index, "reduction": "sum"}
    if "accum_dtype" in params:  # newer releases: float32 grad_weight accumulation, as in the chunked path
        kwargs["accum_dtype"] = torch.float32
    out = fn(hidden.reshape(-1, hidden.size(-1)).contiguous(), weight, targets.reshape(-1).contiguous(), **kwargs)
    loss = out[0] if isinstance(out, tuple) else out  # return_z_loss=True returns (loss, z_loss)
    return loss.float()


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, impl: str = "auto",
                         chunk_tokens: int = 4096, ignore_index: int = -100, *,
                         grads_in_forward: bool = False) -> Tensor:
    """Sum of token CE(hidden @ weight.T, targets) as 0-d float32, by ``impl``.

    ``auto``: ``fused`` where :func:`fused_linear_cross_entropy_available`, else ``chunked``.
    ``plain`` materialises the logits (the reference); ``fused`` raises where unavailable.
    ``chunk_tokens`` and ``grads_in_forward`` apply to ``chunked`` (see
    :func:`chunked_cross_entropy`); Liger picks its own chunking.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "fused" if fused_linear_cross_entropy_available(hidden.device) else "chunked"
    if impl == "plain":
        return plain_linear_cross_entropy(hidden, weight, targets, ignore_index)
    if impl == "fused":
        if not fused_linear_cross_entropy_available(hidden.device):
            raise RuntimeError(f"impl='fused' is unavailable on {hidden.device}: it needs CUDA and Liger-Kernel")
        return _fused_cross_entropy(hidden, weight, targets, ignore_index)
    return chunked_cross_entropy(hidden, weight, targets, chunk_tokens, ignore_index,
                                 grads_in_forward=grads_in_forward)


def resolve_loss_impl(choice: Loss, m: ModelConfig, t: TrainConfig, device: torch.device,
                      plain_fits: str | None = None) -> tuple[Loss, str]:
    """``train.loss`` as ``(impl, why)`` (``why`` empty when it was not ``auto``), for a
    ``train.compile`` already resolved (:func:`flopwise.train.wrap.resolve_compile`).

    ``auto`` under ``compile=model``: the plain loss, inside the compiled graph (the compiler
    fuses the head's matmul with the softmax, no extra pass over the logits), unless the
    memory model says its full logits do not fit -- ``plain_fits`` is then the reason, and
    the fused kernel (Liger, on CUDA) or the chunked loss holds no full logits. Not compiled:
    the fused kernel where it is installed, else chunked, which on this project's CPU
    measurements (docs/benchmarks.md) is both faster and smaller than eager plain."""
    if choice != "auto":
        if choice == "fused" and not fused_linear_cross_entropy_available(device):
            raise ConfigError(["train.loss=fused: no fused linear cross-entropy kernel here (Liger-Kernel on CUDA)"])
        return choice, ""
    fused = fused_linear_cross_entropy_available(device)
    if t.compile == "model":
        if plain_fits is None:
            return "plain", "inside the compiled graph"
        return ("fused" if fused else "chunked"), f"no full logits: {plain_fits}"
    if fused:
        return "fused", "Liger's fused kernel, not compiled"
    return "chunked", "not compiled: fewer passes and no full logits"



def make_loss_fn(model: torch.nn.Module, impl: str = "plain", chunk_tokens: int = 4096,
                 compile_mode: str | None = None) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """``fn(x, y, doc_ids) -> (sum of token losses, weighted aux loss or None)`` for ``model``.

    ``impl``: ``plain`` -- logits (B, T, V) then float32 cross-entropy; ``chunked`` -- the LM
    head and the loss over chunks of ``chunk_tokens`` rows, never holding the whole logits
    (``model/loss.py``); ``fused`` -- a fused linear+CE kernel where one is installed.
    ``compile_mode`` (not None) compiles the whole function: forward, head and loss in one
    graph -- except the fused kernel, which dynamo cannot trace (a Triton launch and host
    reads inside Liger): then the model's forward is compiled as one graph and the kernel
    runs after it, outside, instead of breaking the graph in the middle of the step.
    """
    inner = getattr(model, "module", model)  # DDP holds the model in .module; FSDP2 shards it in place
    moe = bool(getattr(getattr(inner, "cfg", None), "is_moe", False))

    def loss_fn(x: torch.Tensor, y: torch.Tensor, doc_ids: torch.Tensor | None = None):
        if impl == "plain":
            s = loss_sum(model(x, doc_ids) if doc_ids is not None else model(x), y)
        else:
            # Through the (wrapped) model's forward, so DDP/FSDP hooks run; the head weight is
            # read after it, when FSDP has gathered the root's parameters.
            hidden = model(x, doc_ids, return_hidden=True)  # (B, T, D)
            # The backward follows at once, so computing the gradients during the forward costs
            # no extra peak memory and saves recomputing the logits (docs/benchmarks.md#chunked-cross-entropy).
            head = cast(torch.Tensor, inner.head_weight)  # a flopwise Transformer's property
            s = linear_cross_entropy(hidden.flatten(0, 1), head, y.reshape(-1), impl=impl,
                                     chunk_tokens=chunk_tokens, grads_in_forward=torch.is_grad_enabled())
        return s, (inner.aux_loss if moe else None)

    if compile_mode is None:
        return loss_fn
    mode = None if compile_mode == "default" else compile_mode  # None: torch.compile's default
    flash_docs = getattr(inner, "attention_backend", None) == "flash"

    def docs(x: torch.Tensor, doc_ids: torch.Tensor | None):
        # flash's documents are cut here, before the graph (attention.doc_spans): no break, no
        # host read per layer, and T bounds a document so the graph is the same for every batch
        return doc_spans(doc_ids, bound=x.shape[1]) if flash_docs and doc_ids is not None else doc_ids

    if impl != "fused":
        compiled = torch.compile(loss_fn, mode=mode)
        return lambda x, y, doc_ids=None: compiled(x, y, docs(x, doc_ids))
    forward = torch.compile(lambda x, doc_ids: model(x, doc_ids, return_hidden=True), mode=mode)

    def fused_after_compiled_forward(x: torch.Tensor, y: torch.Tensor, doc_ids: torch.Tensor | None = None):
        hidden = forward(x, docs(x, doc_ids))
        head = cast(torch.Tensor, inner.head_weight)  # a flopwise Transformer's property
        s = linear_cross_entropy(hidden.flatten(0, 1), head, y.reshape(-1), impl=impl)
        return s, (inner.aux_loss if moe else None)

    return fused_after_compiled_forward
