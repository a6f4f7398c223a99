"""What is wrapped around the model, in one place and one order (:func:`wrap_for_training`):
activation checkpointing, then torch.compile, then DDP or FSDP2 (``parallel/strategy.py``).
The model itself holds none of it, so the same module trains plain, checkpointed,
compiled or sharded.

- Activation checkpointing: ``full`` recomputes every block's forward in backward (keeps
  only each block's input); ``selective`` does it for every k-th block (0, k, 2k, ...), a
  middle ground between memory and the ~1/3 extra compute of full; ``selective_op`` runs
  every block under a per-op policy (:func:`selective_op_policy`): the outputs of its matmuls
  and attention kernel are saved, the cheap rest (norms, RoPE, activation functions, casts,
  residual adds) is recomputed in backward -- about half a block's saved bytes for no matmul
  recompute (torchtitan's ``selective_ac_option = "op"``).
- Compile: ``model`` compiles the whole loss function (forward, head, loss); ``blocks``
  compiles each block on its own (shorter compile, one graph reused by every layer, and a
  graph break in one block cannot split the others). ``compile_mode=reduce-overhead``
  captures CUDA graphs (for small models where kernel-launch overhead dominates).
- :func:`explain` reports graphs, graph breaks and their reasons before training;
  :class:`RecompileWatch` counts recompilations after warm-up and says why (a recompile
  mid-training is a performance bug).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from flopwise.parallel.strategy import apply_data_parallel
from flopwise.plan.flops import checkpointed_blocks

if TYPE_CHECKING:
    from flopwise.model.transformer import Transformer


_aten = torch.ops.aten
# What train.activation_checkpointing=selective_op saves: every matmul's output and the attention
# kernels' (output and logsumexp). Every matmul, not torchtitan's "all but every second mm": in
# torchtitan's Llama a block makes seven separate projections and the alternation is a memory/compute
# trade tuned to that layout; here a block makes four fused ones (wqkv, wo, w_gate_up|w_up, w_down),
# an MoE block a data-dependent number, so a count-based rule would land on different matrices per
# layout (and per batch for the MoE loop). Saving all of them makes the recompute matmul-free -- what
# the planner counts (plan/flops.py: recomputed_fraction 0, HFU = MFU) and the dry run checks. The
# price: w_down's output is kept though backward never reads it (the residual add saves nothing),
# one (B, T, D) tensor a block in eager mode; compiled, the partitioner drops it (plan/memory.py).
# bmm is the eager attention path's two matmuls (the scores, and scores @ v): saving them keeps that
# reference path matmul-free too (its (B, H, T, T) float32 scores stay, as without checkpointing).
# flex_attention is a higher-order op (traced as one node under compile); not run here: torch has no
# CPU backward for it. Ops missing from an older torch are left out (GPU machines pin 2.11, these 2.13).
_SAVED_ATEN = ("mm", "addmm", "bmm", "_grouped_mm",  # linear layers (flattened to 2-D), eager attention, MoE
               "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_fused_attention_overrideable")
_FLEX = getattr(torch.ops.higher_order, "flex_attention", None)
SELECTIVE_OP_SAVED = frozenset([getattr(_aten, name).default for name in _SAVED_ATEN if hasattr(_aten, name)]
                               + ([_FLEX] if _FLEX is not None else []))


def selective_op_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """``train.activation_checkpointing=selective_op``: MUST_SAVE a matmul's or an attention
    kernel's output (:data:`SELECTIVE_OP_SAVED`; the flash-attn package's custom ops, namespaces
    ``flash_attn`` and ``flash_attn_3``, too), PREFER_RECOMPUTE anything else. Stateless, so one
    function serves every block, forward and recompute, eager and traced by torch.compile."""
    if func in SELECTIVE_OP_SAVED or getattr(func, "namespace", "").startswith("flash_attn"):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_op_context():
    """``context_fn`` of :func:`torch.utils.checkpoint.checkpoint` under ``selective_op``: a fresh
    pair of caching contexts per checkpointed call (they hold that block's saved outputs)."""
    return create_selective_checkpoint_contexts(selective_op_policy)


def apply_activation_checkpointing(model: Transformer, mode: str, every_k: int = 2) -> list[int]:
    """Make the chosen blocks recompute their forward in backward (non-reentrant), in place;
    under ``selective_op`` every block, recomputing only what :func:`selective_op_policy` does
    not save.

    The block's ``forward`` is replaced rather than the block wrapped in another module, so
    parameter names -- checkpoints, exports, optimizer groups -- do not change. It composes
    with the rest of :func:`wrap_for_training`: torch.compile (``blocks`` or ``model``) traces
    the replaced forward, the policy tagging each op for the partitioner (MUST_SAVE nodes kept,
    the rest recomputed in the backward graph); DDP's hooks and FSDP2's per-block all-gather run
    around the block's ``forward``, outside the checkpointed region, so no collective is cached
    or replayed (torchtitan saves reduce-scatters for tensor parallelism, which flopwise lacks)."""
    chosen = checkpointed_blocks(len(model.layers), mode, every_k)
    extra: dict[str, Any] = {"context_fn": selective_op_context} if mode == "selective_op" else {}
    for i in chosen:
        block = model.layers[i]
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():  # evaluation: nothing saved, nothing to recompute
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **extra, **kwargs)

        block.forward = forward
    return chosen


def compile_kwargs(mode: str) -> dict[str, Any]:
    return {} if mode == "default" else {"mode": mode}


def wrap_model(model: Transformer, train_cfg) -> list[str]:
    """Checkpointing, then per-block compile, in place; returns notes for the log.

    ``compile=model`` is applied by the training step to its whole loss function (the
    model's forward, the LM head and the loss in one graph), see ``train/train_step.py``.
    ``compile=blocks`` compiles each block with ``nn.Module.compile`` (in place: names
    unchanged); identical blocks share one compiled graph.
    """
    notes = []
    chosen = apply_activation_checkpointing(model, train_cfg.activation_checkpointing,
                                            train_cfg.activation_checkpointing_every)
    if chosen and train_cfg.activation_checkpointing == "selective_op":
        notes.append(f"activation checkpointing selective_op: each of the {len(chosen)} blocks keeps its matmul and "
                     "attention outputs, the rest (norms, RoPE, activations, casts) is recomputed in backward")
    elif chosen:
        notes.append(f"activation checkpointing {train_cfg.activation_checkpointing}: "
                     f"{len(chosen)} of {len(model.layers)} blocks recomputed in backward")
    if train_cfg.compile == "blocks":
        model.doc_length_bound = True  # flash's document spans: the same graph for every batch
        for block in model.layers:
            block.compile(**compile_kwargs(train_cfg.compile_mode))
    if train_cfg.compile != "off":
        notes.append(f"torch.compile {train_cfg.compile} (mode {train_cfg.compile_mode}); compiling steps are "
                     "left out of throughput")
    return notes


def wrap_for_training(model: Transformer, cfg, strategy: str, env, device: torch.device,
                      compute_dtype: torch.dtype | None) -> tuple[torch.nn.Module, list[str], list[str]]:
    """Activation checkpointing -> compile -> DDP/FSDP2, the only order that works for all
    three: checkpointing replaces block forwards that compile then traces, and DDP's hooks
    and FSDP2's per-block sharding go around the compiled blocks. Returns the module the
    training step calls (a DDP wrapper, or ``model`` itself, sharded in place by FSDP2),
    notes on speed and notes on parallelism for the log."""
    speed_notes = wrap_model(model, cfg.train)
    wrapped, parallel_notes = apply_data_parallel(model, strategy, env, device, cfg, compute_dtype)
    return wrapped, speed_notes, parallel_notes


def explain(model: Callable[..., Any], *example_args) -> dict[str, Any]:
    """Graphs, graph breaks and their reasons for one forward (``torch._dynamo.explain``)."""
    import torch._dynamo  # lazy: ~1 s to import; only compile and --explain need it

    out = torch._dynamo.explain(model)(*example_args)
    reasons = []
    for r in out.break_reasons:
        where = ""
        if getattr(r, "user_stack", None):
            frame = r.user_stack[-1]
            where = f" at {frame.filename}:{frame.lineno}"
        reasons.append(f"{r.reason}{where}")
    return {"graphs": out.graph_count, "graph_breaks": out.graph_break_count, "reasons": reasons,
            "ops": getattr(out, "op_count", None)}


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class RecompileWatch:
    """Counts dynamo (re)compilations; after ``arm()``, any new one is a warning with its reason."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.baseline = 0
        self.reported = 0
        self._capture = _Capture()
        if enabled:
            try:
                torch._logging.set_logs(recompiles=True)
            except Exception:  # pragma: no cover - logging API moved
                pass
            logging.getLogger("torch._dynamo").addHandler(self._capture)

    @staticmethod
    def _frames() -> int:
        from torch._dynamo.utils import counters  # lazy: dynamo only once something was compiled

        return int(counters["stats"]["unique_graphs"])

    def arm(self) -> None:
        """From now on (after warm-up) every compilation counts as a recompile."""
        if self.enabled:
            self.baseline = self.reported = self._frames()
            self._capture.messages.clear()

    def check(self) -> str | None:
        """A warning line when graphs were compiled since the last check, else None."""
        if not self.enabled or self.baseline == 0:
            return None
        now = self._frames()
        if now <= self.reported:
            return None
        new, self.reported = now - self.reported, now
        reasons = [m for m in self._capture.messages if "ecompil" in m][-3:]
        self._capture.messages.clear()
        why = "; ".join(r.strip().replace("\n", " ")[:300] for r in reasons) or "reason not captured"
        return (f"WARNING: {new} recompilation(s) during training ({now - self.baseline} since warm-up): {why} "
                "-- a recompile mid-training is a performance bug (shapes or guards changing)")

    def close(self) -> None:
        if self.enabled:
            logging.getLogger("torch._dynamo").removeHandler(self._capture)
            try:
                torch._logging.set_logs(recompiles=False)
            except Exception:  # pragma: no cover
                pass
