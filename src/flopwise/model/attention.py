"""Causal self-attention kernels behind one interface, chosen by name.

Shapes in comments use B = batch, T = sequence length, H = query heads, KV = key/value
heads (H % KV == 0; query head h reads KV head h // (H // KV)), hd = head dimension.

    attention(q, k, v, backend, doc_ids=None)   q (B, H, T, hd), k/v (B, KV, T, hd) -> (B, H, T, hd)

Backends (``BACKENDS`` minus ``"auto"``):

- ``flash``: the flash-attn package (FA3 ``flash_attn_interface`` on Hopper, else FA2
  ``flash_attn``): CUDA, fp16/bf16 only. Documents via the varlen kernel.
- ``sdpa``: ``F.scaled_dot_product_attention``. Documents need an explicit (B, 1, T, T)
  boolean mask, i.e. O(B T^2) memory and no flash kernel.
- ``flex``: ``torch.nn.attention.flex_attention`` with a ``BlockMask``: block-sparse, so
  documents cost no T^2 mask and fully masked blocks are skipped. Fused only when
  compiled (done here on CUDA); has no backward pass on CPU (as of torch 2.13).
- ``eager``: scores in float32, explicit mask, softmax, matmul. The correctness reference;
  slow and O(B H T^2) memory.

``select_backend`` resolves ``"auto"`` (or a requested backend that is unavailable) to a
usable one and returns notes for the user saying what was chosen and why; the model then
calls ``attention`` with that concrete name on every forward. Probes and imports happen in
``available_backends`` (and the SDPA GQA probe at import), not inside ``attention``, so FLOP
counters, profilers and ``torch.compile`` see only the kernel (plus, for flex, building the
block mask; on CUDA flex compiles itself on first use).

``doc_ids`` (B, T), integer: token i attends token j iff j <= i and both carry the same id
in that row (packed pretraining, see ``flopwise.data.loader.document_ids``). Ids are
expected to form contiguous runs (as packing produces); the flash varlen path *requires*
it, since it cuts the flattened batch into runs. For flash they are cut once per forward
(:func:`doc_spans`, a :class:`DocSpans` every layer reads), never inside a compiled graph:
cutting reads the host (``nonzero``) and its length is the number of documents. A compiled
training step gets them from ``train/train_step.py``'s loss function, cut before the graph with
``T`` as the bound on a document's length and the length marked dynamic: one graph, no
break, one host read per micro-batch, no recompile when the number of documents changes.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from flopwise.errors import FlopwiseError

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    _FLEX_IMPORT_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - older torch
    create_block_mask = flex_attention = None  # type: ignore[assignment]
    _FLEX_IMPORT_ERROR = f"torch.nn.attention.flex_attention missing in torch {torch.__version__} (needs >= 2.5): {exc}"

BACKENDS = ("auto", "flash", "sdpa", "flex", "eager")
CONCRETE_BACKENDS = BACKENDS[1:]
_HALF_DTYPES = (torch.float16, torch.bfloat16)


class AttentionBackendError(FlopwiseError, ValueError):
    """A backend name that is not one of ``BACKENDS``, or one that is unavailable under strict."""


# --------------------------------------------------------------------------- SDPA GQA probe

def _probe_sdpa_gqa() -> bool:
    """Whether ``scaled_dot_product_attention`` takes ``enable_gqa`` (torch >= 2.5).

    The function is a builtin without an inspectable signature, so it is probed with
    tiny tensors -- once, at import: probing lazily would run the probe inside the
    caller's first forward pass, where FLOP counters, profilers or torch.compile see it.
    """
    q = torch.zeros(1, 2, 1, 2)
    kv = torch.zeros(1, 1, 1, 2)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except (TypeError, RuntimeError):
        return False
    return True


_SDPA_HAS_GQA = _probe_sdpa_gqa()


def sdpa_supports_gqa() -> bool:
    """Whether SDPA reads grouped KV heads natively (no H/KV-fold copy of K and V)."""
    return _SDPA_HAS_GQA


# --------------------------------------------------------------------------- masks from doc_ids

def _compiling() -> bool:
    return torch.compiler.is_compiling()


class _PerDocIdsMemo:
    """Values derived from one ``doc_ids`` tensor, reused by every layer of a forward.

    All layers of a forward receive the same ``doc_ids`` object, so its dense mask, block
    mask or cu_seqlens are built once instead of ``n_layers`` times -- and the dense mask
    that SDPA saves for backward is then one tensor shared by all layers, not one each.
    Entries are keyed by the tensor's identity and in-place version and dropped when the
    tensor is freed (weakref.finalize), so nothing outlives its batch. Bypassed while
    ``torch.compile`` traces: the graph then holds the construction instead.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, str], tuple[int, Any]] = {}

    def get(self, doc_ids: torch.Tensor, kind: str, build: Callable[[], Any]) -> Any:
        if _compiling():
            return build()
        key = (id(doc_ids), kind)
        hit = self._entries.get(key)
        if hit is not None and hit[0] == doc_ids._version:
            return hit[1]
        value = build()
        if hit is None:
            weakref.finalize(doc_ids, self._entries.pop, key, None)
        self._entries[key] = (doc_ids._version, value)
        return value

    def clear(self) -> None:
        self._entries.clear()


_DOC_MEMO = _PerDocIdsMemo()


def dense_allowed_mask(doc_ids: torch.Tensor | None, T: int, device: torch.device) -> torch.Tensor:
    """Boolean "may attend" mask: (T, T) causal, or (B, 1, T, T) causal & same document.

    True = attend (SDPA's boolean convention). O(B T^2) bytes with documents.
    """
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()  # (T, T)
    if doc_ids is None:
        return causal
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    return (same_doc & causal)[:, None]  # (B, 1, T, T)


def _doc_dense_mask(doc_ids: torch.Tensor, T: int, device: torch.device) -> torch.Tensor:
    return _DOC_MEMO.get(doc_ids, "dense", lambda: dense_allowed_mask(doc_ids, T, device))


def cu_seqlens_from_doc_ids(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cut the flattened batch (B*T tokens) into documents for flash-attn's varlen kernel.

    Returns ``cu_seqlens`` (int32, (N+1,): start offset of each of the N documents in the
    flattened batch, then B*T) and ``max_seqlen`` (python int, the longest document).
    A document is a maximal run of equal ids within one row; a row boundary always cuts,
    even if the id continues (each row is its own sequence). ``max_seqlen`` costs one
    device->host sync, hence once per forward (:func:`doc_spans`).
    """
    cu_seqlens = _doc_starts(doc_ids)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
    return cu_seqlens, max_seqlen


# --------------------------------------------------------------------------- eager

def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
    """Reference: every step explicit, scores and softmax in float32."""
    B, H, T, hd = q.shape
    n_rep = H // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)  # (B, H, T, hd)
        v = v.repeat_interleave(n_rep, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # (B, H, T, T)
    if doc_ids is None:
        allowed = dense_allowed_mask(None, T, q.device)  # (T, T)
    else:
        allowed = _doc_dense_mask(doc_ids, T, q.device)  # (B, 1, T, T)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)  # (B, H, T, T); the diagonal is never masked
    return torch.matmul(probs, v).to(q.dtype)  # (B, H, T, hd)


# --------------------------------------------------------------------------- sdpa

def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None,
                   use_gqa: bool | None = None) -> torch.Tensor:
    """SDPA, causal or per-document causal. ``use_gqa=None`` uses native GQA when torch has it;
    ``False`` repeats each KV head H/KV times (what GQA means, at the cost of a copy)."""
    T = q.shape[2]
    n_rep = q.shape[1] // k.shape[1]
    if use_gqa is None:
        # With a document mask on CUDA, flash is out (it takes no mask) and the memory-efficient
        # kernel takes no GQA: native GQA would send it to the math kernel, which stores
        # (B, H, T, T) scores. Repeated KV heads keep it on the efficient one (the dry run's
        # trace found it: tests/integration/test_dryrun.py).
        use_gqa = _SDPA_HAS_GQA and not (doc_ids is not None and q.device.type == "cuda")
    kwargs: dict[str, Any] = {}
    if n_rep > 1:
        if use_gqa:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(n_rep, dim=1)  # (B, H, T, hd)
            v = v.repeat_interleave(n_rep, dim=1)
    if doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
    mask = _doc_dense_mask(doc_ids, T, q.device)  # (B, 1, T, T) bool, True = attend
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)


# --------------------------------------------------------------------------- flex

_CAUSAL_BLOCK_MASKS: dict[tuple[int, torch.device], Any] = {}
_COMPILED: dict[str, Callable] = {}


def _causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _doc_causal_mod(doc_ids: torch.Tensor):
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])
    return mask_mod


def _compiled(name: str, fn: Callable) -> Callable:
    """``torch.compile(fn)``, made once. Not while already tracing: the outer compile inlines ``fn``."""
    if _compiling():
        return fn
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=False)
    return _COMPILED[name]


def _block_mask_builder(device: torch.device) -> Callable:
    # Eager create_block_mask evaluates the mask_mod densely over (B, T, T) -- with a doc
    # gather that is several int64 (B, T, T) temporaries; compiled, it is one fused pass.
    return _compiled("create_block_mask", create_block_mask) if device.type == "cuda" else create_block_mask


def flex_block_mask(T: int, device: torch.device, doc_ids: torch.Tensor | None = None):
    """The ``BlockMask`` for causal (cached per (T, device)) or per-document causal attention
    (built per ``doc_ids``: B rows, heads broadcast; memoised for the layers of one forward)."""
    device = torch.device(device)
    if doc_ids is None:
        key = (T, device)
        if _compiling():
            return create_block_mask(_causal_mod, None, None, T, T, device=device)
        if key not in _CAUSAL_BLOCK_MASKS:  # built once, (T, T) evaluation: no need to compile it
            _CAUSAL_BLOCK_MASKS[key] = create_block_mask(_causal_mod, None, None, T, T, device=device)
        return _CAUSAL_BLOCK_MASKS[key]
    B = doc_ids.shape[0]
    # The BlockMask keeps its mask_mod, so the closure gets a copy: holding the memo's key
    # tensor itself would keep it alive forever (and its memo entry with it).
    return _DOC_MEMO.get(
        doc_ids, "block",
        lambda: _block_mask_builder(device)(_doc_causal_mod(doc_ids.clone()), B, None, T, T, device=device))


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
    """flex_attention with a block mask. Compiled on CUDA (eager flex materialises the full
    score matrix); on CPU it runs eagerly -- forward only, torch has no CPU backward for it."""
    if flex_attention is None:  # pragma: no cover - older torch
        raise AttentionBackendError(_FLEX_IMPORT_ERROR)
    block_mask = flex_block_mask(q.shape[2], q.device, doc_ids)
    fn: Callable[..., torch.Tensor] = flex_attention
    if q.device.type == "cuda":
        fn = _compiled("flex_attention", flex_attention)
    return fn(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])  # (B, H, T, hd)


# --------------------------------------------------------------------------- flash

@dataclass(frozen=True)
class _FlashKernels:
    version: str  # "FA3" or "FA2"
    module: str  # what was imported
    func: Callable  # (B, T, H, hd) layout
    varlen_func: Callable  # (total, H, hd) layout + cu_seqlens


_FLASH_BY_DEVICE: dict[torch.device, _FlashKernels | str] = {}


def _try_import(name: str) -> tuple[Any, str | None]:
    """Import ``name``; (module, None) or (None, why). flash-attn wheels built against
    another torch fail with OSError/undefined symbol, not just ImportError."""
    if importlib.util.find_spec(name) is None:
        return None, "not installed"
    try:
        return importlib.import_module(name), None
    except Exception as exc:  # noqa: BLE001 - any failure means unusable
        return None, f"import failed: {type(exc).__name__}: {exc}"


def _resolve_flash(device: torch.device) -> _FlashKernels | str:
    """The flash-attn kernels usable on ``device`` (a CUDA device), or the reason there are none.

    FA3 (``flash_attn_interface``, the ``hopper/`` build) on compute capability 9.x when it
    imports; otherwise FA2 (``flash_attn``), which needs sm80+ (Ampere or newer).
    """
    cap = torch.cuda.get_device_capability(device)
    why = []
    if cap[0] == 9 and torch.version.hip is None:
        mod, err = _try_import("flash_attn_interface")
        if mod is not None:
            return _FlashKernels("FA3", "flash_attn_interface", mod.flash_attn_func, mod.flash_attn_varlen_func)
        why.append(f"FA3 flash_attn_interface {err}")
    mod, err = _try_import("flash_attn")
    if mod is None:
        why.append(f"flash-attn package {err}")
        return "; ".join(why)
    if cap < (8, 0) and torch.version.hip is None:
        return f"flash-attn 2 needs compute capability >= 8.0 (Ampere or newer), device has {cap[0]}.{cap[1]}"
    return _FlashKernels("FA2", "flash_attn", mod.flash_attn_func, mod.flash_attn_varlen_func)


def _flash_kernels(device: torch.device) -> _FlashKernels:
    """Kernels for ``device``, resolved once (normally already by ``available_backends``)."""
    device = _normalize_device(device)
    if device not in _FLASH_BY_DEVICE:
        _FLASH_BY_DEVICE[device] = _resolve_flash(device) if device.type == "cuda" else "needs CUDA"
    found = _FLASH_BY_DEVICE[device]
    if isinstance(found, str):
        raise AttentionBackendError(f"flash attention unavailable on {device}: {found}")
    return found


def _doc_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """cu_seqlens without the host read: the (N+1,) int32 offsets of :func:`cu_seqlens_from_doc_ids`."""
    B, T = doc_ids.shape
    starts = torch.ones(B, T, dtype=torch.bool, device=doc_ids.device)  # (B, T) position 0 starts a doc
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    offsets = starts.reshape(-1).nonzero().squeeze(1)  # (N,) start of each document
    end = torch.tensor([B * T], dtype=offsets.dtype, device=offsets.device)
    return torch.cat([offsets, end]).to(torch.int32)  # (N+1,)


class DocSpans(NamedTuple):
    """A packed batch's documents for flash-attn's varlen kernel, cut once per forward."""

    ids: torch.Tensor  # (B, T) the document ids
    cu_seqlens: torch.Tensor  # (N+1,) int32: where each document starts in the flattened batch, then B*T
    max_seqlen: int  # the longest document, or an upper bound on it (T)


def doc_spans(doc_ids: torch.Tensor, bound: int | None = None) -> DocSpans:
    """:class:`DocSpans` of ``doc_ids`` (B, T), cut eagerly. ``bound`` (e.g. T) in place of the
    longest document's length, for a compiled graph that should not specialise on it; the
    length of ``cu_seqlens`` (the number of documents) is then marked dynamic for the same reason."""
    if bound is None:
        cu_seqlens, max_seqlen = cu_seqlens_from_doc_ids(doc_ids)
        return DocSpans(doc_ids, cu_seqlens, max_seqlen)
    import torch._dynamo  # lazy: ~1 s to import; only a compiled step with documents needs it

    cu_seqlens = _doc_starts(doc_ids)
    torch._dynamo.mark_dynamic(cu_seqlens, 0)
    return DocSpans(doc_ids, cu_seqlens, bound)


def _first(out):
    """Some FA3 releases return (out, softmax_lse) even when not asked to."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           doc_ids: torch.Tensor | DocSpans | None) -> torch.Tensor:
    """flash-attn wants time before heads, and reads grouped KV heads natively. Documents:
    the model's :class:`DocSpans` (a bare ``doc_ids`` tensor is cut here, memoised)."""
    kern = _flash_kernels(q.device)
    B, H, T, hd = q.shape
    KV = k.shape[1]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, T, H|KV, hd), last dim contiguous
    if doc_ids is None:
        out = _first(kern.func(qt, kt, vt, causal=True))  # (B, T, H, hd)
    else:
        spans = (doc_ids if isinstance(doc_ids, DocSpans)
                 else _DOC_MEMO.get(doc_ids, "spans", lambda: doc_spans(doc_ids)))
        # (traced with a bare tensor -- compile=blocks, or the model compiled by hand -- this
        # cuts in the graph: a break per layer. The trainer's compiled step passes DocSpans.)
        cu_seqlens, max_seqlen = spans.cu_seqlens, spans.max_seqlen
        out = _first(kern.varlen_func(
            qt.reshape(B * T, H, hd), kt.reshape(B * T, KV, hd), vt.reshape(B * T, KV, hd),  # (B*T, H|KV, hd)
            cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True,
        )).view(B, T, H, hd)
    return out.transpose(1, 2)  # (B, H, T, hd)


# --------------------------------------------------------------------------- dispatch

_KERNELS: dict[str, Callable] = {"flash": _flash, "sdpa": sdpa_attention, "flex": _flex, "eager": _eager}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str,
              doc_ids: torch.Tensor | DocSpans | None = None) -> torch.Tensor:
    """Causal attention, scale 1/sqrt(hd), with kernel ``backend`` (a concrete name, not "auto").

    q: (B, H, T, hd); k, v: (B, KV, T, hd) with H % KV == 0 (GQA/MQA: query head h reads KV
    head h // (H // KV)). ``doc_ids`` (B, T) integer: token i attends j only if j <= i and
    doc_ids[b, i] == doc_ids[b, j] (for flash, :class:`DocSpans` of them: :func:`doc_spans`).
    Returns (B, H, T, hd) in q's dtype.
    """
    kernel = _KERNELS.get(backend)
    if kernel is None:
        if backend == "auto":
            raise AttentionBackendError("attention() needs a concrete backend; resolve 'auto' with select_backend()")
        raise AttentionBackendError(f"unknown attention backend {backend!r}; valid: {', '.join(CONCRETE_BACKENDS)}")
    B, H, T, hd = q.shape
    if k.shape != v.shape or k.dim() != 4 or k.shape[0] != B or k.shape[2] != T or k.shape[3] != hd:
        raise ValueError(f"k, v must be (B, KV, T, hd) = ({B}, KV, {T}, {hd}); got {tuple(k.shape)}, {tuple(v.shape)}")
    if H % k.shape[1] != 0:
        raise ValueError(f"query heads {H} not a multiple of key/value heads {k.shape[1]}")
    if isinstance(doc_ids, DocSpans) and backend != "flash":
        doc_ids = doc_ids.ids  # spans are cut for flash's varlen kernel; the others read the ids
    ids = doc_ids.ids if isinstance(doc_ids, DocSpans) else doc_ids
    if ids is not None:
        if tuple(ids.shape) != (B, T):
            raise ValueError(f"doc_ids must be (B, T) = ({B}, {T}); got {tuple(ids.shape)}")
        if ids.device != q.device and not isinstance(doc_ids, DocSpans):
            doc_ids = ids.to(q.device)  # (ids is doc_ids here) defeats the per-forward memo: pass doc_ids on q's device
    return kernel(q, k, v, doc_ids)


def attend_to_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Queries at the END of a key/value cache (incremental decoding): q (B, H, Tq, hd) holds
    positions Tk - Tq .. Tk - 1 of k, v (B, KV, Tk, hd). Causal in that offset sense: query i
    sees keys 0 .. Tk - Tq + i. With Tq = 1 (a new token) nothing is masked."""
    Tq, Tk = q.shape[2], k.shape[2]
    n_rep = q.shape[1] // k.shape[1]
    kwargs: dict[str, Any] = {}
    if n_rep > 1:
        if _SDPA_HAS_GQA:
            kwargs["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)  # (B, H, Tk, hd)
    if Tq == 1:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)  # (Tq, Tk)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, **kwargs)


# --------------------------------------------------------------------------- availability & selection

def _normalize_device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


_FLEX_PROBES: dict[str, str | None] = {}


def _flex_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why flex cannot train on ``device``, or None.

    CUDA: compiled through Triton, so Triton must import. Other devices: torch's flex has
    a forward there but (as of 2.13) refuses backward -- probed, with tensors that require
    grad, so a torch that adds it is picked up. The refusal happens before any compute;
    a successful probe costs one tiny eager flex call (its first compile), once.
    """
    if _FLEX_IMPORT_ERROR is not None:
        return _FLEX_IMPORT_ERROR
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "flex_attention on CUDA is compiled with Triton, which is not installed"
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"flex_attention on CUDA needs fp16/bf16/fp32, not {dtype}"
        return None
    if device.type not in _FLEX_PROBES:
        q = torch.zeros(1, 1, 1, 8, device=device, requires_grad=True)
        try:
            flex_attention(q, q, q)
            _FLEX_PROBES[device.type] = None
        except NotImplementedError as exc:
            msg = str(exc)
            if "backward" in msg:
                msg = (f"no backward pass on {device.type} in torch {torch.__version__} "
                       "(flex_attention is forward-only there)")
            _FLEX_PROBES[device.type] = msg
        except Exception as exc:  # noqa: BLE001 - whatever fails, it is unusable here
            _FLEX_PROBES[device.type] = f"flex_attention fails on {device.type}: {type(exc).__name__}: {exc}"
    return _FLEX_PROBES[device.type]


def available_backends(device: torch.device, dtype: torch.dtype) -> dict[str, str | None]:
    """For each concrete backend: None if it can run forward *and* backward on this
    device/dtype, else the reason it cannot (all reasons, joined by '; ').

    Pass the compute dtype (the autocast dtype under mixed precision), not the parameter dtype.
    """
    device = _normalize_device(device)
    reasons: dict[str, str | None] = {}
    if device.type == "cuda" and not torch.cuda.is_available():
        # Nothing runs there; say so for the CUDA-only kernels and let sdpa/eager fail loudly later.
        why = f"CUDA not available (torch {torch.__version__})"
        return {"flash": why, "sdpa": None, "flex": why, "eager": None}

    flash_why = []
    if device.type != "cuda":
        flash_why.append("needs CUDA")
    if dtype not in _HALF_DTYPES:
        flash_why.append("needs fp16/bf16")
    if device.type == "cuda":
        if device not in _FLASH_BY_DEVICE:
            _FLASH_BY_DEVICE[device] = _resolve_flash(device)
        found = _FLASH_BY_DEVICE[device]
        if isinstance(found, str):
            flash_why.append(found)
    else:
        mod_why = _flash_package_reason()
        if mod_why:
            flash_why.append(mod_why)
    reasons["flash"] = "; ".join(flash_why) or None

    has_sdpa = hasattr(F, "scaled_dot_product_attention")
    reasons["sdpa"] = None if has_sdpa else "torch has no scaled_dot_product_attention"
    reasons["flex"] = _flex_reason(device, dtype)
    reasons["eager"] = None
    return reasons


def _flash_package_reason() -> str | None:
    """Off CUDA only whether some flash-attn is installed (import would pull in CUDA libs)."""
    if importlib.util.find_spec("flash_attn") is None and importlib.util.find_spec("flash_attn_interface") is None:
        return "flash-attn package not installed"
    return None


def flash_version(device) -> str | None:
    """Which flash-attn ("FA3" or "FA2") runs on ``device`` (dtype permitting), else None."""
    device = _normalize_device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    found = _FLASH_BY_DEVICE.get(device)
    if found is None:
        found = _FLASH_BY_DEVICE[device] = _resolve_flash(device)
    return None if isinstance(found, str) else found.version


_DOC_MASK_SDPA_NOTE = ("sdpa applies the document mask as an explicit (B, 1, T, T) boolean tensor: O(B*T^2) "
                       "memory and no flash kernel (flash or flex avoid this)")


def _describe(name: str, device: torch.device) -> str:
    if name == "flash":
        return f"flash ({flash_version(device) or 'flash-attn'})"
    if name == "flex" and device.type != "cuda":
        return "flex (eager, unfused)"
    if name == "eager":
        return "eager (reference: float32 (B, H, T, T) scores; slow)"
    return name


def _auto(avail: dict[str, str | None], device: torch.device, doc_mask: bool) -> tuple[str, list[str]]:
    """The preference order: flash > flex (only for documents) > sdpa > eager; notes say why
    each better one was skipped."""
    skipped: list[str] = []
    if avail["flash"] is None:
        return "flash", skipped
    skipped.append(f"flash skipped: {avail['flash']}")
    if doc_mask:
        if avail["flex"] is None:
            return "flex", skipped
        skipped.append(f"flex skipped: {avail['flex']}")
    if avail["sdpa"] is None:
        if doc_mask:
            skipped.append(_DOC_MASK_SDPA_NOTE)
        return "sdpa", skipped
    skipped.append(f"sdpa skipped: {avail['sdpa']}")
    return "eager", skipped


def select_backend(requested: str, device, dtype, doc_mask: bool = False,
                   strict: bool = False) -> tuple[str, list[str]]:
    """Resolve ``requested`` ("auto" or a concrete name) to a backend usable on device/dtype.

    Returns (name, notes): log lines saying what was chosen and, for auto, why better ones
    were skipped; for an unavailable requested backend, the fallback (auto's choice) and
    why -- or AttentionBackendError under ``strict``. Unknown names always raise.
    """
    if requested not in BACKENDS:
        raise AttentionBackendError(f"unknown attention backend {requested!r}; valid: {', '.join(BACKENDS)}")
    device = _normalize_device(device)
    avail = available_backends(device, dtype)
    where = f"{device}/{str(dtype).replace('torch.', '')}"
    if requested == "auto":
        name, why = _auto(avail, device, doc_mask)
        return name, [f"attention: auto -> {_describe(name, device)} on {where}", *why]
    reason = avail[requested]
    if reason is None:
        notes = [f"attention: {_describe(requested, device)} on {where}"]
        if requested == "sdpa" and doc_mask:
            notes.append(_DOC_MASK_SDPA_NOTE)
        return requested, notes
    if strict:
        raise AttentionBackendError(f"attention backend {requested!r} unavailable on {where}: {reason}")
    name, why = _auto(avail, device, doc_mask)
    notes = [f"attention: {requested} unavailable on {where} ({reason}); falling back to {_describe(name, device)}"]
    notes += [w for w in why if not w.startswith(f"{requested} skipped")]
    return name, notes
