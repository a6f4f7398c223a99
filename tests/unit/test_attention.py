"""Attention kernels: every backend agrees with the eager reference (which is itself checked
against a loop), documents are isolated, backend selection explains itself, flash's varlen
plumbing is right (with stand-in kernels: flash-attn needs CUDA)."""

import gc
import math

import pytest
import torch

from flopwise.model import attention as A
from flopwise.model.attention import (
    BACKENDS,
    AttentionBackendError,
    attention,
    available_backends,
    cu_seqlens_from_doc_ids,
    sdpa_attention,
    sdpa_supports_gqa,
    select_backend,
)

# flex on CPU runs eagerly (unfused) and says so once; expected here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

CPU = torch.device("cpu")
HAS_FLEX = A.flex_attention is not None
# flex can run forward on CPU even where it cannot train (no backward): check its numbers anyway.
FORWARD_BACKENDS = ["sdpa", "eager"] + (["flex"] if HAS_FLEX else [])
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}  # (H, KV)


def qkv(H, KV, B=3, T=19, hd=8, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, hd, generator=g)  # (B, H, T, hd)
    k = torch.randn(B, KV, T, hd, generator=g)  # (B, KV, T, hd)
    v = torch.randn(B, KV, T, hd, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def make_doc_ids(T=19, device="cpu"):
    """(3, T): row 0 three documents, row 1 one document, row 2 other boundaries incl. 1-token docs."""
    rows = [
        [0] * 5 + [1] * 9 + [2] * (T - 14),
        [0] * T,
        [0] + [1] * 2 + [2] * (T - 7) + [3] + [4] * 3,
    ]
    assert all(len(r) == T for r in rows)
    return torch.tensor(rows, dtype=torch.int64, device=device)  # (B, T)


SHORT_DOCS = torch.tensor([[0] * 4 + [1] * 7, [0] * 11, [0] + [1] * 2 + [2] * 5 + [3] * 3])  # (3, 11)


# --------------------------------------------------------------------------- the reference

def loop_attention(q, k, v, doc_ids=None):
    """Scalar loops in float64: out[b,h,i] = sum_j softmax_j(q.k_j / sqrt(hd)) v_j over allowed j."""
    B, H, T, hd = q.shape
    group = H // k.shape[1]
    out = torch.zeros(B, H, T, hd, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kv = h // group
            for i in range(T):
                js = [j for j in range(i + 1) if doc_ids is None or doc_ids[b, i] == doc_ids[b, j]]
                logits = [float(q[b, h, i].double() @ k[b, kv, j].double()) / math.sqrt(hd) for j in js]
                m = max(logits)
                w = [math.exp(x - m) for x in logits]
                z = sum(w)
                for wj, j in zip(w, js):
                    out[b, h, i] += (wj / z) * v[b, kv, j].double()
    return out


@pytest.mark.parametrize("docs", [False, True])
def test_eager_matches_hand_written_loop(docs):
    q, k, v = qkv(4, 2, B=2, T=6, hd=4)
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]]) if docs else None
    out = attention(q, k, v, "eager", doc_ids)
    assert out.shape == (2, 4, 6, 4) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), loop_attention(q, k, v, doc_ids), rtol=1e-5, atol=1e-6)


def test_first_token_of_each_document_reads_only_itself():
    q, k, v = qkv(2, 2, B=1, T=6, hd=4)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1]])
    out = attention(q, k, v, "eager", doc_ids)
    torch.testing.assert_close(out[0, :, 0], v[0, :, 0])
    torch.testing.assert_close(out[0, :, 3], v[0, :, 3])  # new document: no earlier token visible


# --------------------------------------------------------------------------- backends agree

@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
@pytest.mark.parametrize("backend", FORWARD_BACKENDS)
def test_backend_matches_eager(backend, heads, docs):
    H, KV = HEADS[heads]
    q, k, v = qkv(H, KV)
    doc_ids = make_doc_ids() if docs else None
    ref = attention(q, k, v, "eager", doc_ids)  # (B, H, T, hd)
    out = attention(q, k, v, backend, doc_ids)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def _torch_takes_enable_gqa() -> bool:
    """Asked of torch here, apart from the module's import-time probe: whether SDPA accepts
    ``enable_gqa`` -- and, when it does, gives what repeating each KV head gives."""
    q, k, v = qkv(4, 2, B=1, T=5, hd=4)
    try:
        native = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    except (TypeError, RuntimeError):
        return False
    k2, v2 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(native, torch.nn.functional.scaled_dot_product_attention(q, k2, v2, is_causal=True))
    return True


def test_sdpa_gqa_probe_says_what_torch_does():
    """The probe's answer is what this torch really does; torch >= 2.5 (the pinned 2.13 and
    the GPU machines' 2.11 among them) has ``enable_gqa``, so there it must be True."""
    assert sdpa_supports_gqa() is _torch_takes_enable_gqa()
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 5):
        assert sdpa_supports_gqa(), f"torch {torch.__version__} has enable_gqa but the probe says no"


@pytest.mark.parametrize("heads", ["gqa", "mqa"])
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
def test_sdpa_repeated_kv_matches_eager(heads, docs):
    H, KV = HEADS[heads]
    q, k, v = qkv(H, KV)
    doc_ids = make_doc_ids() if docs else None
    ref = attention(q, k, v, "eager", doc_ids)
    torch.testing.assert_close(sdpa_attention(q, k, v, doc_ids, use_gqa=False), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads", ["gqa", "mqa"])
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
def test_sdpa_native_gqa_matches_eager(heads, docs, monkeypatch):
    """``use_gqa=True`` really hands SDPA the KV heads ungrouped with ``enable_gqa`` (not a
    silent repeat), and matches eager. Skipped, with its reason in the summary, only on a
    torch without ``enable_gqa`` (the probe test above checks that answer)."""
    if not sdpa_supports_gqa():
        pytest.skip(f"torch {torch.__version__}: scaled_dot_product_attention has no enable_gqa")
    H, KV = HEADS[heads]
    q, k, v = qkv(H, KV)
    doc_ids = make_doc_ids() if docs else None
    ref = attention(q, k, v, "eager", doc_ids)
    real, calls = A.F.scaled_dot_product_attention, []

    def sdpa(q_, k_, v_, **kw):
        calls.append((k_.shape[1], kw.get("enable_gqa")))
        return real(q_, k_, v_, **kw)

    monkeypatch.setattr(A.F, "scaled_dot_product_attention", sdpa)
    torch.testing.assert_close(sdpa_attention(q, k, v, doc_ids, use_gqa=True), ref, rtol=1e-5, atol=1e-6)
    assert calls == [(KV, True)]


def test_single_document_equals_plain_causal():
    q, k, v = qkv(4, 2)
    one_doc = torch.full((3, 19), 7)
    for backend in FORWARD_BACKENDS:
        torch.testing.assert_close(attention(q, k, v, backend, one_doc), attention(q, k, v, backend),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", FORWARD_BACKENDS)
def test_documents_are_isolated(backend):
    """Row 0 holds documents [0:5), [5:14), [14:19). Perturbing document 1 leaves document
    2's outputs alone under the document mask, and changes them under plain causal."""
    q, k, v = qkv(4, 2)
    doc_ids = make_doc_ids()
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    g = torch.Generator().manual_seed(1)
    for t in (q2, k2, v2):
        t[0, :, 5:14] += torch.randn(t[0, :, 5:14].shape, generator=g)
    doc2 = slice(14, 19)

    masked, masked2 = attention(q, k, v, backend, doc_ids), attention(q2, k2, v2, backend, doc_ids)
    torch.testing.assert_close(masked2[0, :, doc2], masked[0, :, doc2], rtol=0, atol=1e-6)
    torch.testing.assert_close(masked2[0, :, :5], masked[0, :, :5], rtol=0, atol=1e-6)  # before: causal anyway
    assert not torch.allclose(masked2[0, :, 5:14], masked[0, :, 5:14])  # the perturbed document itself moves
    torch.testing.assert_close(masked2[1:], masked[1:], rtol=0, atol=1e-6)  # other rows untouched

    plain, plain2 = attention(q, k, v, backend), attention(q2, k2, v2, backend)
    assert (plain2[0, :, doc2] - plain[0, :, doc2]).abs().max() > 1e-3


# --------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
def test_sdpa_gradients_match_eager(heads, docs):
    H, KV = HEADS[heads]
    doc_ids = SHORT_DOCS if docs else None
    grads = {}
    for backend in ("eager", "sdpa"):
        q, k, v = (t.requires_grad_() for t in qkv(H, KV, T=11))
        out = attention(q, k, v, backend, doc_ids)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads[backend] = (q.grad, k.grad, v.grad)
    for g_sdpa, g_eager in zip(grads["sdpa"], grads["eager"]):
        torch.testing.assert_close(g_sdpa, g_eager, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_FLEX, reason="torch without flex_attention")
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
def test_flex_gradients_match_eager_or_are_reported_unavailable(docs):
    """Where available_backends says flex can train, its grads match eager; where it says it
    cannot (CPU: torch has no flex backward there), flex really refuses a backward."""
    doc_ids = SHORT_DOCS if docs else None
    reason = available_backends(CPU, torch.float32)["flex"]
    q, k, v = (t.requires_grad_() for t in qkv(4, 2, T=11))
    if reason is not None:
        with pytest.raises(NotImplementedError, match="backward"):
            attention(q, k, v, "flex", doc_ids)
        return
    attention(q, k, v, "flex", doc_ids).sum().backward()
    qe, ke, ve = (t.requires_grad_() for t in qkv(4, 2, T=11))
    attention(qe, ke, ve, "eager", doc_ids).sum().backward()
    for a, b in ((q, qe), (k, ke), (v, ve)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- flash plumbing (stand-in kernels)

def _seq_attention(q, k, v):
    """One sequence in flash's layout: q (T, H, hd), k/v (T, KV, hd) -> (T, H, hd), causal."""
    T, H, hd = q.shape
    kv_of_head = torch.arange(H) // (H // k.shape[1])
    k, v = k[:, kv_of_head], v[:, kv_of_head]  # (T, H, hd)
    s = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(hd)  # (H, T, T)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hij,jhd->ihd", s.softmax(-1), v)


def _fake_kernels(tuple_out: bool):
    calls = []

    def func(q, k, v, causal=False):  # (B, T, H, hd)
        assert causal and q.dim() == 4 and q.shape[1] == k.shape[1]
        calls.append("dense")
        out = torch.stack([_seq_attention(q[b], k[b], v[b]) for b in range(q.shape[0])])
        return (out, None) if tuple_out else out

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=False):  # (total, H, hd)
        assert causal and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and max_q == max_k
        bounds = cu_q.tolist()
        assert bounds[0] == 0 and bounds[-1] == q.shape[0]
        assert max_q == max(e - s for s, e in zip(bounds, bounds[1:]))
        calls.append("varlen")
        out = torch.empty_like(q)
        for s, e in zip(bounds, bounds[1:]):
            out[s:e] = _seq_attention(q[s:e], k[s:e], v[s:e])
        return (out, None) if tuple_out else out

    return A._FlashKernels("FA2", "stand-in", func, varlen), calls


@pytest.mark.parametrize("tuple_out", [False, True], ids=["fa2-out", "fa3-tuple"])
@pytest.mark.parametrize("heads", HEADS)
def test_flash_path_layouts_and_varlen_match_eager(monkeypatch, heads, tuple_out):
    kernels, calls = _fake_kernels(tuple_out)
    monkeypatch.setattr(A, "_flash_kernels", lambda device: kernels)
    H, KV = HEADS[heads]
    q, k, v = qkv(H, KV)
    doc_ids = make_doc_ids()
    for d in (None, doc_ids):
        out = attention(q, k, v, "flash", d)
        assert out.shape == q.shape
        torch.testing.assert_close(out, attention(q, k, v, "eager", d), rtol=1e-5, atol=1e-6)
    assert calls == ["dense", "varlen"]


def test_cu_seqlens_from_doc_ids():
    doc_ids = torch.tensor([
        [0, 0, 0, 1, 1],  # docs of 3 and 2
        [1, 1, 1, 1, 1],  # same id as row 0's last doc: a row boundary still cuts
        [0, 1, 1, 1, 2],  # 1, 3, 1
    ])
    cu, max_len = cu_seqlens_from_doc_ids(doc_ids)
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 3, 5, 10, 11, 14, 15]
    assert max_len == 5 and isinstance(max_len, int)

    cu, max_len = cu_seqlens_from_doc_ids(make_doc_ids())
    assert cu.tolist() == [0, 5, 14, 19, 38, 39, 41, 53, 54, 57]
    assert max_len == 19


# --------------------------------------------------------------------------- selection

def test_available_backends_on_cpu():
    avail = available_backends(CPU, torch.float32)
    assert list(avail) == ["flash", "sdpa", "flex", "eager"]
    assert avail["sdpa"] is None and avail["eager"] is None
    assert "needs CUDA" in avail["flash"] and "needs fp16/bf16" in avail["flash"]
    assert "needs fp16/bf16" not in available_backends(CPU, torch.bfloat16)["flash"]
    if not HAS_FLEX:
        assert "flex_attention" in avail["flex"]
        return
    # The flex verdict is what flex really does here: it must train (forward + backward).
    q = torch.zeros(1, 1, 4, 8, requires_grad=True)
    try:
        attention(q, q, q, "flex").sum().backward()
        trains = True
    except NotImplementedError:
        trains = False
    assert (avail["flex"] is None) == trains, avail["flex"]


def test_auto_on_cpu_picks_sdpa_and_says_why_not_flash():
    name, notes = select_backend("auto", "cpu", torch.float32)
    assert name == "sdpa"
    text = "\n".join(notes)
    assert "auto -> sdpa" in text and "flash skipped" in text and "needs CUDA" in text


def test_auto_with_doc_mask_on_cpu_notes_the_dense_mask():
    avail = available_backends(CPU, torch.float32)
    name, notes = select_backend("auto", CPU, torch.float32, doc_mask=True)
    text = "\n".join(notes)
    if avail["flex"] is None:
        assert name == "flex"
    else:
        assert name == "sdpa"
        assert "flex skipped" in text and "(B, 1, T, T)" in text


def fake_available(**reasons):
    base = {"flash": "needs CUDA", "sdpa": None, "flex": None, "eager": None}
    base.update(reasons)
    return lambda device, dtype: dict(base)


def test_auto_prefers_flex_for_documents_only(monkeypatch):
    monkeypatch.setattr(A, "available_backends", fake_available())
    assert select_backend("auto", CPU, torch.float32, doc_mask=True)[0] == "flex"
    assert select_backend("auto", CPU, torch.float32, doc_mask=False)[0] == "sdpa"
    monkeypatch.setattr(A, "available_backends", fake_available(flex="no flex here"))
    name, notes = select_backend("auto", CPU, torch.float32, doc_mask=True)
    assert name == "sdpa" and any("no flex here" in n for n in notes)


def test_auto_prefers_flash_when_available(monkeypatch):
    monkeypatch.setattr(A, "available_backends", fake_available(flash=None))
    for doc_mask in (False, True):
        name, notes = select_backend("auto", CPU, torch.bfloat16, doc_mask=doc_mask)
        assert name == "flash" and not any("skipped" in n for n in notes)


def test_eager_fallback_when_nothing_else(monkeypatch):
    monkeypatch.setattr(A, "available_backends", fake_available(sdpa="no sdpa", flex="no flex"))
    name, notes = select_backend("auto", CPU, torch.float32)
    assert name == "eager" and any("no sdpa" in n for n in notes)


def test_unavailable_request_falls_back_or_raises_when_strict():
    name, notes = select_backend("flash", "cpu", torch.float32)
    assert name == "sdpa"
    assert "flash unavailable" in notes[0] and "falling back to sdpa" in notes[0] and "needs CUDA" in notes[0]
    with pytest.raises(AttentionBackendError, match="needs CUDA"):
        select_backend("flash", "cpu", torch.float32, strict=True)


def test_available_request_is_honoured():
    for requested in ("sdpa", "eager"):
        name, notes = select_backend(requested, CPU, torch.float32, strict=True)
        assert name == requested and notes
    _, notes = select_backend("sdpa", CPU, torch.float32, doc_mask=True)
    assert any("(B, 1, T, T)" in n for n in notes)


def test_unknown_names_raise_with_the_valid_list():
    assert BACKENDS == ("auto", "flash", "sdpa", "flex", "eager")
    with pytest.raises(AttentionBackendError, match="auto, flash, sdpa, flex, eager"):
        select_backend("flash2", CPU, torch.float32)
    assert issubclass(AttentionBackendError, ValueError)
    q, k, v = qkv(2, 2, T=4)
    with pytest.raises(AttentionBackendError, match="flash, sdpa, flex, eager"):
        attention(q, k, v, "xformers")
    with pytest.raises(AttentionBackendError, match="select_backend"):
        attention(q, k, v, "auto")


def test_shape_checks():
    q, k, v = qkv(4, 3, T=4)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, k, v, "sdpa")
    q, k, v = qkv(4, 2, T=4)
    with pytest.raises(ValueError, match="doc_ids"):
        attention(q, k, v, "sdpa", torch.zeros(3, 5, dtype=torch.long))


# --------------------------------------------------------------------------- per-forward memo

def test_doc_masks_are_built_once_per_doc_ids_and_released():
    A._DOC_MEMO.clear()
    q, k, v = qkv(4, 2)
    doc_ids = make_doc_ids()
    key = (id(doc_ids), "dense")
    attention(q, k, v, "sdpa", doc_ids)
    first = A._DOC_MEMO._entries[key][1]
    attention(q, k, v, "eager", doc_ids)  # a second layer: same mask object
    assert A._DOC_MEMO._entries[key][1] is first
    doc_ids[0, 3:] = 9  # in-place change: rebuilt
    out = attention(q, k, v, "sdpa", doc_ids)
    assert A._DOC_MEMO._entries[key][1] is not first
    torch.testing.assert_close(out, attention(q, k, v, "eager", doc_ids.clone()), rtol=1e-5, atol=1e-6)
    if HAS_FLEX:
        attention(q, k, v, "flex", doc_ids)
    del doc_ids
    gc.collect()
    assert not any(kid == key[0] for kid, _ in A._DOC_MEMO._entries)


# --------------------------------------------------------------------------- CUDA

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
def test_cuda_backends_match_eager_bf16(heads, docs):
    dev = torch.device("cuda")
    avail = available_backends(dev, torch.bfloat16)
    H, KV = HEADS[heads]
    T = 200  # not a multiple of flex's 128-token blocks
    doc_ids = None
    if docs:
        doc_ids = torch.zeros(2, T, dtype=torch.int64, device=dev)
        doc_ids[0, 50:] = 1
        doc_ids[0, 170:] = 2
        doc_ids[1, 129:] = 1
    q, k, v = (t.requires_grad_() for t in qkv(H, KV, B=2, T=T, hd=64, dtype=torch.bfloat16, device=dev))
    ref = attention(q, k, v, "eager", doc_ids)
    ref.float().square().sum().backward()
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    checked = []
    for backend in ("flash", "flex", "sdpa"):
        if avail[backend] is not None:
            continue
        for t in (q, k, v):
            t.grad = None
        out = attention(q, k, v, backend, doc_ids)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
        out.float().square().sum().backward()
        for g, g_ref in zip((q.grad, k.grad, v.grad), ref_grads):
            torch.testing.assert_close(g, g_ref, rtol=5e-2, atol=5e-2)
        checked.append(backend)
    assert "sdpa" in checked
