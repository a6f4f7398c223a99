"""Mixture-of-experts SwiGLU MLP with top-k routing (Qwen3-MoE), and its Hugging Face weight mapping.

Shapes in comments use B = batch, T = sequence length, D = d_model, E = experts,
k = experts per token (top_k), F = each expert's SwiGLU hidden width, N = B*T tokens and
S = N*k token-slots (one per token and chosen expert).

Routing is Qwen3-MoE's, operation for operation, so that a checkpoint gives the same
outputs here and in ``transformers``::

    probs = softmax(router(x)) in float32                      (N, E)
    w, idx = topk(probs, k); w /= w.sum() if norm_topk_prob      (N, k) each
    out[t] = sum_j w[t, j] * expert_{idx[t, j]}(x[t]),   expert(x) = down(silu(gate(x)) * up(x))

Dispatch: the S token-slots are sorted by expert, so that each expert's tokens are one
contiguous slice, and the experts run as one grouped matmul (``torch._grouped_mm``) or,
where that kernel is unavailable, as a loop over the E experts (never over tokens).
The outputs are scattered back with ``index_add`` weighted by the routing weights.

Auxiliary losses (``MoE.aux`` after each forward; the model weights and adds them):

* ``load_balance`` = E * sum_e f_e * P_e (Switch Transformer eq. 4, as in Qwen-MoE), with
  f_e the fraction of the S token-slots routed to expert e (sum_e f_e = 1) and P_e the
  router probability of e averaged over tokens (sum_e P_e = 1). Perfectly balanced
  routing gives exactly **1.0** for every E and k; the maximum is E / k (every token
  sends its k slots to the same k experts and puts all its probability on one of them;
  E for top-1). ``transformers``' ``load_balancing_loss_func`` normalises f by tokens
  instead of token-slots (its f sums to k), so for one layer it returns k times this
  value: our coefficient c matches theirs at c * k (Qwen3-MoE's router_aux_loss_coef
  0.001 with top-8 is 0.008 here).
* ``z`` = mean_t logsumexp(logits_t)^2 (ST-MoE, Zoph et al. 2022): keeps router logits
  small, which bf16 softmax needs.
* ``tokens_per_expert`` (E,) int64, no grad: tokens routed to each expert (sums to S),
  for logging how balanced the routing is.

Hugging Face layout (one layer, keys relative to ``model.layers.{i}.mlp.``)::

    ours                     transformers 5.x (in memory)   transformers 4.x / hub files
    router.weight  (E, D)    gate.weight                    gate.weight
    w_gate_up  (E, 2F, D)    experts.gate_up_proj           experts.{e}.gate_proj.weight (F, D)
      rows [gate F | up F]                                  experts.{e}.up_proj.weight   (F, D)
    w_down     (E, D, F)     experts.down_proj              experts.{e}.down_proj.weight (D, F)

What transformers 5.23 does with files (checked with a tiny ``Qwen3MoeForCausalLM``):
``save_pretrained`` writes the **per-expert 4.x keys** (it converts its fused in-memory
parameters back, so files stay readable by 4.x and other tools), and ``from_pretrained``
loads **both** a safetensors file with per-expert keys and one with the fused 5.x keys,
with no missing or unexpected keys and identical logits. :func:`moe_from_hf` accepts
both layouts; :func:`moe_to_hf` writes the fused one by default (what a 5.x model's
``load_state_dict`` takes) or the per-expert one on request.
"""

from __future__ import annotations

import math
import sys
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Tensor = torch.Tensor

# --------------------------------------------------------------------------- grouped matmul

# The public wrapper (torch >= 2.10) calls the private op; older torch has only the op.
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)

# (device type, device index, dtype) -> whether the grouped kernel works there. Filled
# by probing: on CPU at import, on accelerators on first use (see grouped_mm_supported).
_GROUPED_MM_OK: dict[tuple[str, int | None, torch.dtype], bool] = {}

try:  # hide the probe from dispatch modes (FLOP counters, fake-tensor tracing)
    from torch.utils._python_dispatch import _disable_current_modes
except ImportError:  # pragma: no cover - very old torch
    import contextlib

    _disable_current_modes = contextlib.nullcontext  # type: ignore[assignment]  # same use: a no-op context


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Run the grouped kernel once, forward and backward, on tiny tensors with an empty
    group, and compare with per-group ``mm``. Any exception or mismatch means "no".

    Whether the kernel runs depends on the torch version, device and dtype (its docs
    promise bf16 on CUDA SM >= 80; older CPU builds have no kernel; torch 2.13's CPU
    build runs float32, bf16 and float16), so asking the kernel is simpler than keeping
    a table of versions. Run outside autocast, inference mode and
    dispatch modes, so that the answer does not depend on where it is first asked.
    """
    if _GROUPED_MM is None:
        return False
    try:
        with _disable_current_modes(), torch.inference_mode(False), torch.enable_grad(), \
                torch.autocast(device.type, enabled=False):
            gen = torch.Generator().manual_seed(0)
            a = torch.randn(12, 16, generator=gen).to(device, dtype).requires_grad_()  # (S, K)
            w = torch.randn(3, 8, 16, generator=gen).to(device, dtype).requires_grad_()  # (G, N, K), like our weights
            g = torch.randn(12, 8, generator=gen).to(device, dtype)  # (S, N) upstream gradient
            offs = torch.tensor([5, 5, 12], dtype=torch.int32, device=device)  # group 1 is empty
            y = _GROUPED_MM(a, w.transpose(1, 2), offs=offs)  # (S, N)
            ga, gw = torch.autograd.grad(y, (a, w), g)
            y_ref = torch.cat([a[:5] @ w[0].T, a[5:] @ w[2].T])
            ga_ref, gw_ref = torch.autograd.grad(y_ref, (a, w), g, allow_unused=True)
            gw_ref = torch.zeros_like(w) if gw_ref is None else gw_ref
            tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4  # rtol and atol
            return bool(
                y.shape == y_ref.shape
                and torch.allclose(y.float(), y_ref.float(), rtol=tol, atol=tol)
                and torch.allclose(ga.float(), ga_ref.float(), rtol=tol, atol=tol)
                and torch.allclose(gw.float(), gw_ref.float(), rtol=tol, atol=tol)
                and not gw[1].any()  # an empty group must get a zero gradient, not garbage
            )
    except Exception:  # noqa: BLE001 - any failure means "use the loop"
        return False


def grouped_mm_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` works (forward and backward) on ``device`` for ``dtype``.

    Probed once per (device, dtype) and cached. CPU dtypes are probed at import; call
    this once for an accelerator before ``torch.compile(fullgraph=True)`` or a profiler
    so that the probe does not run inside the first traced/profiled forward.
    """
    device = torch.device(device)
    key = (device.type, device.index, dtype)
    ok = _GROUPED_MM_OK.get(key)
    if ok is None:
        ok = _GROUPED_MM_OK[key] = _outside_any_graph(_probe_grouped_mm)(device, dtype)
    return ok


def _outside_any_graph(fn: Callable[..., bool]) -> Callable[..., bool]:
    """``fn``, kept out of a graph torch.compile traces (``torch.compiler.disable``) when dynamo is
    loaded; when it is not, nothing is being compiled, and importing it (about 2 s of CPU) is
    left to what needs it (torch.compile; torch's optimizers and meta-device init load it too)."""
    return torch.compiler.disable(fn) if "torch._dynamo" in sys.modules else fn


for _dt in (torch.float32, torch.bfloat16, torch.float16):
    grouped_mm_supported("cpu", _dt)


def _strides_fit_grouped_mm(d_model: int, hidden: int, dtype: torch.dtype) -> bool:
    """The kernel wants every stride a multiple of 16 bytes: rows of D and of F elements
    (the activations and the transposed weight views) must then be 16-byte multiples."""
    size = dtype.itemsize
    return (d_model * size) % 16 == 0 and (hidden * size) % 16 == 0


# --------------------------------------------------------------------------- the layer

class MoE(nn.Module):
    """Top-k routed mixture of SwiGLU experts; a drop-in replacement for ``SwiGLU``.

    Expert weights are stored stacked, (E, out, in) like ``nn.Linear`` weights, which is
    both transformers 5.x's layout and what a grouped matmul consumes (as a transposed
    view, no copy). ``dispatch`` selects the expert computation: ``"auto"`` (grouped
    matmul where :func:`grouped_mm_supported` and the shapes allow, else the loop),
    ``"grouped_mm"`` or ``"loop"``; all give the same result.
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int, ffn_hidden: int, norm_topk_prob: bool = True):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
        self.d_model = d_model
        self.n_experts = n_experts
        self.top_k = top_k
        self.ffn_hidden = ffn_hidden
        self.norm_topk_prob = norm_topk_prob
        self.router = nn.Linear(d_model, n_experts, bias=False)  # logits (N, E)
        # Per expert rows [gate (F) | up (F)]: one GEMM instead of two, as in SwiGLU.
        self.w_gate_up = nn.Parameter(torch.empty(n_experts, 2 * ffn_hidden, d_model))  # (E, 2F, D)
        self.w_down = nn.Parameter(torch.empty(n_experts, d_model, ffn_hidden))  # (E, D, F)
        self.dispatch = "auto"
        self.aux: dict[str, Tensor] = {}
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's default per expert (uniform, bound 1/sqrt(fan_in)). Training runs
        re-initialise everything in ``init_weights``; this only makes a standalone layer
        usable. A no-op on the meta device."""
        self.router.reset_parameters()
        nn.init.uniform_(self.w_gate_up, -1 / math.sqrt(self.d_model), 1 / math.sqrt(self.d_model))
        nn.init.uniform_(self.w_down, -1 / math.sqrt(self.ffn_hidden), 1 / math.sqrt(self.ffn_hidden))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_experts={self.n_experts}, top_k={self.top_k}, "
                f"ffn_hidden={self.ffn_hidden}, norm_topk_prob={self.norm_topk_prob}")

    # ------------------------------------------------------------------ routing

    def route(self, xt: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """xt (N, D) -> logits (N, E), probs (N, E) float32, top-k weights (N, k) and indices (N, k).

        Softmax over all E experts in float32 *before* top-k (not a softmax of the top-k
        logits): the weights are probabilities under the full router, renormalised over
        the chosen k when ``norm_topk_prob``, as in Qwen3-MoE.
        """
        logits = self.router(xt)  # (N, E), activation dtype (bf16 under autocast)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (N, E)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)  # (N, k) each
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return logits, probs, top_w, top_i

    # ------------------------------------------------------------------ expert computation

    def _use_grouped_mm(self, x: Tensor, dtype: torch.dtype) -> bool:
        if self.dispatch != "auto":
            if self.dispatch not in ("grouped_mm", "loop"):
                raise ValueError(f"MoE.dispatch must be auto, grouped_mm or loop, got {self.dispatch!r}")
            return self.dispatch == "grouped_mm"
        if not _strides_fit_grouped_mm(self.d_model, self.ffn_hidden, dtype):
            return False
        if not (self.w_gate_up.is_contiguous() and self.w_down.is_contiguous()):
            return False
        if torch.compiler.is_compiling():
            # The kernel's shape function (used while tracing) accepts only bf16, whatever
            # the eager kernel supports (torch 2.13).
            if dtype != torch.bfloat16:
                return False
        else:  # pointers are not known while tracing
            if self.w_gate_up.data_ptr() % 16 or self.w_down.data_ptr() % 16:  # e.g. mmap-loaded weights
                return False
        key = (x.device.type, x.device.index, dtype)
        ok = _GROUPED_MM_OK.get(key)
        if ok is None:
            ok = grouped_mm_supported(x.device, dtype)
        return ok

    def _experts_grouped(self, xs: Tensor, counts: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
        """xs (S, D) sorted by expert, counts (E,) -> (S, D). One kernel per projection and
        no host synchronisation: the group boundaries stay on the device."""
        assert _GROUPED_MM is not None  # taken only where grouped_mm_supported()
        offs = counts.cumsum(0).to(torch.int32)  # (E,) end of each expert's rows
        h = _GROUPED_MM(xs, w_gate_up.transpose(1, 2), offs=offs)  # (S, 2F)
        gate, up = h.chunk(2, dim=-1)  # each (S, F)
        return _GROUPED_MM(F.silu(gate) * up, w_down.transpose(1, 2), offs=offs)  # (S, D)

    def _experts_loop(self, xs: Tensor, counts: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
        """Same as the grouped path with one pair of GEMMs per expert that got tokens.

        ``unbind`` and ``split`` (not ``w[e]`` or slicing in the loop) keep the backward to
        one stacking/concatenation per tensor; per-expert indexing would materialise a
        full-size zero gradient for every expert.
        """
        sizes = counts.tolist()  # the one host sync of this path
        # Empty experts are skipped in eager mode; while tracing, the sizes are symbolic
        # and a branch on them cannot be compiled, so empty GEMMs run instead (harmless).
        skip_empty = not torch.compiler.is_compiling()
        outs = []
        for n, x_e, wgu_e, wd_e in zip(sizes, xs.split(sizes), w_gate_up.unbind(0), w_down.unbind(0)):
            if skip_empty and n == 0:
                continue
            gate, up = F.linear(x_e, wgu_e).chunk(2, dim=-1)  # each (n_e, F)
            outs.append(F.linear(F.silu(gate) * up, wd_e))  # (n_e, D)
        if not outs:  # no tokens at all
            return xs.new_zeros(0, self.d_model)
        return torch.cat(outs)  # (S, D)

    # ------------------------------------------------------------------ forward

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        E, k = self.n_experts, self.top_k
        xt = x.reshape(-1, D)  # (N, D)
        N = xt.shape[0]
        logits, probs, top_w, top_i = self.route(xt)
        top_w = top_w.to(x.dtype)  # (N, k)

        # Sort the N*k token-slots by expert: slot s = t*k + j belongs to token t = s // k.
        # Stable, so each expert's tokens stay in token order (deterministic).
        flat_i = top_i.reshape(-1)  # (S,)
        order = torch.argsort(flat_i, stable=True)  # (S,)
        token = order // k  # (S,) token of each sorted slot
        # Per-expert counts with a fixed output size (bincount's size is data-dependent).
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat_i, torch.ones_like(flat_i))
        xs = xt.index_select(0, token)  # (S, D) each expert's tokens contiguous
        ws = top_w.reshape(-1).index_select(0, order)  # (S,) routing weight of each sorted slot

        # Under autocast the loop's F.linear computes in the autocast dtype; the grouped
        # kernel is not autocast-aware, so it gets the same casts explicitly.
        w_gate_up, w_down = self.w_gate_up, self.w_down
        dtype = x.dtype
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        if self._use_grouped_mm(x, dtype):
            ys = self._experts_grouped(xs.to(dtype), counts, w_gate_up.to(dtype), w_down.to(dtype))
        else:
            ys = self._experts_loop(xs, counts, w_gate_up, w_down)  # (S, D)

        # Weighted scatter back; a token's k contributions are added in expert order,
        # as transformers' loop over experts does.
        contrib = (ys * ws[:, None]).to(x.dtype)  # (S, D)
        out = torch.zeros_like(xt).index_add(0, token, contrib)  # (N, D)

        # Auxiliary losses (module docstring). f is a count, so the load-balance gradient
        # reaches the router through P only.
        f = counts.to(torch.float32) / (N * k)  # (E,) sums to 1
        P = probs.mean(dim=0)  # (E,) sums to 1
        self.aux = {
            "load_balance": E * torch.sum(f * P),
            "z": torch.logsumexp(logits.float(), dim=-1).square().mean(),
            "tokens_per_expert": counts.detach(),
        }
        return out.view(B, T, D)


# --------------------------------------------------------------------------- HF weight mapping

def moe_to_hf(sd: dict[str, Tensor], prefix: str = "", layout: str = "fused") -> dict[str, Tensor]:
    """One layer's MoE weights (keys ``router.weight``, ``w_gate_up``, ``w_down``) in HF names.

    Keys of the result are ``prefix`` + the suffixes relative to ``model.layers.{i}.mlp.``.
    ``layout="fused"`` gives transformers 5.x's ``gate.weight``, ``experts.gate_up_proj``,
    ``experts.down_proj`` (the tensors themselves, not copies); ``layout="per_expert"``
    the 4.x/hub keys ``experts.{e}.{gate,up,down}_proj.weight`` (what ``save_pretrained``
    writes, readable by 4.x and other tools).
    """
    router, w_gate_up, w_down = sd["router.weight"], sd["w_gate_up"], sd["w_down"]
    if layout == "fused":
        return {prefix + "gate.weight": router, prefix + "experts.gate_up_proj": w_gate_up,
                prefix + "experts.down_proj": w_down}
    if layout != "per_expert":
        raise ValueError(f"layout must be 'fused' or 'per_expert', got {layout!r}")
    ffn = w_gate_up.shape[1] // 2
    out = {prefix + "gate.weight": router}
    for e in range(w_gate_up.shape[0]):
        out[f"{prefix}experts.{e}.gate_proj.weight"] = w_gate_up[e, :ffn].contiguous()  # (F, D)
        out[f"{prefix}experts.{e}.up_proj.weight"] = w_gate_up[e, ffn:].contiguous()  # (F, D)
        out[f"{prefix}experts.{e}.down_proj.weight"] = w_down[e].contiguous()  # (D, F)
    return out


def moe_from_hf(sd: dict[str, Tensor], n_experts: int, prefix: str = "") -> dict[str, Tensor]:
    """HF MoE-block weights (keys ``prefix`` + suffix relative to ``model.layers.{i}.mlp.``)
    -> ours (``router.weight``, ``w_gate_up``, ``w_down``), ready for ``MoE.load_state_dict``.

    Accepts the fused transformers 5.x layout and the per-expert layout of 4.x-era hub
    checkpoints (and of files written by 5.x ``save_pretrained``); the fused one wins if
    both are present. A missing key raises ``KeyError`` naming the full HF key; a wrong
    number of experts raises ``ValueError``.
    """

    def get(key: str) -> Tensor:
        if prefix + key not in sd:
            raise KeyError(f"missing Hugging Face key {prefix + key!r}")
        return sd[prefix + key]

    router = get("gate.weight")  # (E, D)
    if prefix + "experts.gate_up_proj" in sd or prefix + "experts.down_proj" in sd:
        w_gate_up = get("experts.gate_up_proj")  # (E, 2F, D)
        w_down = get("experts.down_proj")  # (E, D, F)
    else:
        if prefix + f"experts.{n_experts}.gate_proj.weight" in sd:
            raise ValueError(f"checkpoint has more than n_experts={n_experts} experts under {prefix!r}")
        gate_up, down = [], []
        for e in range(n_experts):
            gate = get(f"experts.{e}.gate_proj.weight")  # (F, D)
            up = get(f"experts.{e}.up_proj.weight")  # (F, D)
            gate_up.append(torch.cat([gate, up], dim=0))  # (2F, D)
            down.append(get(f"experts.{e}.down_proj.weight"))  # (D, F)
        w_gate_up = torch.stack(gate_up)  # (E, 2F, D)
        w_down = torch.stack(down)  # (E, D, F)
    for name, t in (("gate.weight", router), ("experts.gate_up_proj", w_gate_up), ("experts.down_proj", w_down)):
        if t.shape[0] != n_experts:
            raise ValueError(f"{prefix}{name} has {t.shape[0]} experts, expected n_experts={n_experts}")
    return {"router.weight": router, "w_gate_up": w_gate_up, "w_down": w_down}
