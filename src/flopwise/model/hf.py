"""Weight and config mapping between flopwise and Hugging Face ``transformers``.

Four families, named by ``model.arch``: ``llama`` (LlamaForCausalLM: Llama 2/3, SmolLM),
``qwen3`` (Qwen3ForCausalLM), ``qwen3_moe`` (Qwen3MoeForCausalLM) and ``gpt2``
(GPT2LMHeadModel). A config whose components do not match its family (see
``flopwise.config.hf_mismatches``), or ``arch=custom``, is refused: never exported as
something it is not.

Our layout fuses projections that HF keeps separate (Llama/Qwen3 names; GPT-2 below)::

    ours                                   HF
    tok_emb.weight                         model.embed_tokens.weight
    layers.{i}.attn_norm.weight            model.layers.{i}.input_layernorm.weight
    layers.{i}.attn.wqkv.{weight,bias}     model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}
        rows [q: H*hd | k: KV*hd | v: KV*hd]
    layers.{i}.attn.wo.{weight,bias}       model.layers.{i}.self_attn.o_proj.{weight,bias}
    layers.{i}.attn.{q,k}_norm.weight      model.layers.{i}.self_attn.{q,k}_norm.weight  (qwen3)
    layers.{i}.mlp_norm.weight             model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.mlp.w_gate_up.{weight,bias} model.layers.{i}.mlp.{gate,up}_proj.{weight,bias}
        rows [gate: F | up: F]
    layers.{i}.mlp.w_down.{weight,bias}    model.layers.{i}.mlp.down_proj.{weight,bias}
    layers.{i}.mlp.{router.weight,         model.layers.{i}.mlp.{gate.weight,            (qwen3_moe,
        w_gate_up, w_down}                     experts.gate_up_proj, experts.down_proj}   see moe.py)
    norm.weight                            model.norm.weight
    lm_head.weight (untied only)           lm_head.weight (always written; equal to the
                                           embedding when tied)

GPT-2 stores its projections as ``Conv1D`` weights of shape (in, out), the transpose of
``nn.Linear``'s, with q/k/v fused as ours are::

    tok_emb / pos_emb                      transformer.wte / transformer.wpe
    layers.{i}.attn_norm, mlp_norm         transformer.h.{i}.ln_1, ln_2  (weight, bias)
    layers.{i}.attn.wqkv, attn.wo          transformer.h.{i}.attn.c_attn, attn.c_proj  (weight.T, bias)
    layers.{i}.mlp.w_up, mlp.w_down        transformer.h.{i}.mlp.c_fc, mlp.c_proj  (weight.T, bias)
    norm                                   transformer.ln_f

RoPE uses HF's rotate-half convention, so no row permutation is needed either way.
``transformers`` (a core dependency) is imported inside the functions that need it, not at
the top: importing it costs seconds that reading a checkpoint does not need.

A Hugging Face ``config.json`` becomes a ``ModelConfig`` here (:func:`config_from_hf`,
:func:`read_hf_config`); ``flopwise.config.build_config`` receives :func:`read_hf_config`
from its caller for ``model.hf_config`` (the config layer imports nothing from ``model``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from flopwise import deps
from flopwise.config import ModelConfig, hf_mismatches, model_problems, model_value_problems, type_problem
from flopwise.errors import FlopwiseError
from flopwise.fsio import FileFormatError, read_json
from flopwise.model.moe import moe_from_hf, moe_to_hf
from flopwise.plan.flops import size_problems

if TYPE_CHECKING:
    from flopwise.model.transformer import Transformer

FAMILIES = ("llama", "qwen3", "qwen3_moe", "gpt2")


class HFMappingError(FlopwiseError, ValueError):
    """A model or config with no faithful Hugging Face equivalent; the message says why."""


def check_exportable(cfg: ModelConfig) -> None:
    problems = hf_mismatches(cfg)
    if problems:
        raise HFMappingError("no Hugging Face equivalent for this model: " + "; ".join(problems))


# --------------------------------------------------------------------------- configs

SPECIAL_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def hf_config(cfg: ModelConfig, special: dict[str, int | None] | None = None) -> Any:
    """The ``transformers`` config of ``cfg``'s family, equivalent to ``cfg``.

    ``special``: ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``, from the tokenizer
    (see ``flopwise.model.io``); each one not given is None. A ``ModelConfig`` does not know its
    tokenizer, so the families' defaults (Llama: bos 1, eos 2; GPT-2: 50256) are never
    kept: in another vocabulary they are ordinary tokens, and ``generate()`` would start
    every text from one."""
    hf = _hf_config(cfg)
    for key in SPECIAL_KEYS:
        setattr(hf, key, (special or {}).get(key))
    return hf


def _hf_config(cfg: ModelConfig) -> Any:
    check_exportable(cfg)
    transformers = deps.load("transformers", "a Hugging Face config (flopwise export --format hf)")
    if cfg.arch == "gpt2":
        return transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layers,
            n_head=cfg.n_heads, n_inner=cfg.ffn_hidden, activation_function="gelu_new",
            layer_norm_epsilon=cfg.norm_eps, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
        )
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.resolved_head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=cfg.attn_bias,
        initializer_range=cfg.init_std,
    )
    # transformers 5 keeps RoPE settings in ``rope_parameters``; 4.x reads ``rope_theta``.
    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    extra: dict[str, Any]
    if cfg.arch == "llama":
        cls, extra = transformers.LlamaConfig, dict(mlp_bias=cfg.mlp_bias)
    elif cfg.arch == "qwen3":
        cls, extra = transformers.Qwen3Config, dict(use_sliding_window=False)
    else:  # qwen3_moe: every layer sparse
        cls, extra = transformers.Qwen3MoeConfig, dict(
            use_sliding_window=False, num_experts=cfg.n_experts, num_experts_per_tok=cfg.moe_top_k,
            moe_intermediate_size=cfg.expert_ffn_hidden, norm_topk_prob=cfg.moe_norm_topk_prob,
            # transformers' load-balance loss is top_k times ours (it averages over tokens,
            # ours over token-slots; see moe.py), so its coefficient is ours / top_k.
            decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=cfg.moe_aux_loss_coef / cfg.moe_top_k,
        )
    if _config_has_rope_parameters(cls):
        hf = cls(**common, **extra, rope_parameters=rope)
    else:  # transformers 4.x
        hf = cls(**common, **extra, rope_theta=float(cfg.rope_theta))
    if _hf_rope_theta(hf) != float(cfg.rope_theta):
        raise RuntimeError(f"rope_theta {cfg.rope_theta} did not reach the {cls.__name__}")
    return hf


def _config_has_rope_parameters(cls: type[Any]) -> bool:
    import inspect

    try:
        return "rope_parameters" in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def _hf_rope_theta(hf: Any) -> float:
    rp = getattr(hf, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    return float(getattr(hf, "rope_theta", 10000.0))


def _get(hf: Any, name: str, default: Any = None) -> Any:
    """A field of an HF config object or of a plain ``config.json`` dict."""
    return hf.get(name, default) if isinstance(hf, dict) else getattr(hf, name, default)


def _as_hf_config(hf: dict) -> Any:
    """A ``config.json`` dict as its ``transformers`` config object: the class supplies the
    defaults that ``save_pretrained`` leaves out (e.g. Qwen3-MoE's ``norm_topk_prob``) and
    the renamed keys (``num_local_experts``). Without transformers, the dict as it is."""
    try:
        from transformers import AutoConfig
    except ImportError:  # pragma: no cover - transformers is in the test extras
        return {("num_experts" if k == "num_local_experts" else k): v for k, v in hf.items()}
    fields = {k: v for k, v in hf.items() if k != "model_type"}
    return AutoConfig.for_model(hf["model_type"], **fields)


def read_hf_config(path: str) -> ModelConfig:
    """The ``ModelConfig`` of the Hugging Face ``config.json`` at ``path`` (the file, or the
    directory holding it), checked (:func:`config_from_hf`). :class:`HFMappingError` naming
    the file when it is missing, not JSON (too large, not UTF-8, nested too deeply: see
    :func:`flopwise.fsio.read_json`), not a supported family or not a model flopwise can build."""
    p = Path(path).expanduser()
    file = p / "config.json" if p.is_dir() else p
    try:
        data = read_json(file)
    except FileNotFoundError:
        raise HFMappingError(f"{file} does not exist") from None
    except FileFormatError as e:
        raise HFMappingError(str(e)) from None
    if not isinstance(data, dict):
        raise HFMappingError(f"{file} is not a JSON object")
    return config_from_hf(data, where=str(file))


# config.json key -> the ModelConfig field it becomes, per family (also how a problem names it)
HF_KEYS: dict[str, dict[str, str]] = {
    "llama": {"vocab_size": "vocab_size", "hidden_size": "d_model", "num_hidden_layers": "n_layers",
              "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads", "head_dim": "head_dim",
              "intermediate_size": "ffn_hidden", "max_position_embeddings": "max_seq_len", "rope_theta": "rope_theta",
              "rms_norm_eps": "norm_eps", "initializer_range": "init_std", "attention_bias": "attn_bias",
              "mlp_bias": "mlp_bias", "tie_word_embeddings": "tie_embeddings"},
    "gpt2": {"vocab_size": "vocab_size", "n_embd": "d_model", "n_layer": "n_layers", "n_head": "n_heads",
             "n_inner": "ffn_hidden", "n_positions": "max_seq_len", "layer_norm_epsilon": "norm_eps",
             "initializer_range": "init_std", "tie_word_embeddings": "tie_embeddings"},
}
HF_KEYS["qwen3"] = HF_KEYS["llama"]
HF_KEYS["qwen3_moe"] = {**HF_KEYS["llama"], "num_experts": "n_experts", "num_local_experts": "n_experts",
                        "num_experts_per_tok": "moe_top_k", "moe_intermediate_size": "moe_ffn_hidden",
                        "norm_topk_prob": "moe_norm_topk_prob"}
_DERIVED_WHEN_NULL = ("head_dim", "num_key_value_heads", "n_inner")  # null: computed from the other keys


def _hf_names(model_type: str) -> dict[str, str]:
    """ModelConfig field -> the config.json key that sets it (GPT-2's n_kv_heads is its n_head)."""
    names: dict[str, str] = {}
    for key, name in HF_KEYS[model_type].items():
        names.setdefault(name, key)
    if model_type == "gpt2":
        names["n_kv_heads"] = "n_head"
    return names


def _in_hf_names(problems: list[str], model_type: str) -> list[str]:
    """``problems`` of a ModelConfig with each ``model.FIELD`` named by its config.json key."""
    names = _hf_names(model_type)
    return [re.sub(r"\bmodel\.(\w+)", lambda m: names.get(m.group(1), m.group(0)), p) for p in problems]


def _named(label: str) -> Callable[[str], str]:
    """A ``label`` for :func:`flopwise.config.model_value_problems` that names every field ``label``."""
    return lambda name: label


def _raw_problems(hf: dict, model_type: str) -> list[str]:
    """What is wrong with the values of a ``config.json`` dict that flopwise maps, one value at a
    time (type, finiteness, sign: :func:`flopwise.config.model_value_problems`), named by
    their keys -- before ``transformers`` sees them (it divides by the head count, and fails
    a string with a validation traceback)."""
    keys = HF_KEYS[model_type]
    given = {k: hf[k] for k in keys if k in hf and not (hf[k] is None and k in _DERIVED_WHEN_NULL)}
    out = []
    for key, value in given.items():
        out += model_value_problems({keys[key]: value}, label=_named(key))
    for holder in ("rope_parameters", "rope_scaling"):
        rp = hf.get(holder)
        if isinstance(rp, dict) and "rope_theta" in rp:
            out += model_value_problems({"rope_theta": rp["rope_theta"]}, label=_named(f"{holder}.rope_theta"))
    return out


def config_from_hf(hf: Any, where: str = "") -> ModelConfig:
    """The ``ModelConfig`` of a ``transformers`` config (object or ``config.json`` dict) of a
    supported family, checked like a run's (:func:`flopwise.config.model_problems`) and against
    :data:`flopwise.plan.flops.MAX_PARAMETERS` before anything is built. A value that is not
    right -- ``"hidden_size": "64"``, ``"num_attention_heads": 0``, a NaN ``rope_theta``, sizes
    no machine holds -- is an :class:`HFMappingError` naming ``where`` (the file) and the key."""
    try:
        return _config_from_hf(hf)
    except HFMappingError as e:
        if not where:
            raise
        raise HFMappingError(f"{where}: {e}") from None


def _config_from_hf(hf: Any) -> ModelConfig:
    model_type = _get(hf, "model_type", "")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise HFMappingError(f"Hugging Face model_type {model_type!r} is not supported; "
                             f"supported: {', '.join(FAMILIES)}")
    if isinstance(hf, dict):
        problems = _raw_problems(hf, model_type)
        if problems:
            raise HFMappingError("; ".join(problems))
        try:
            hf = _as_hf_config(hf)
        except Exception as e:  # transformers' own checks of the values: the file's fault, not ours
            text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
            raise HFMappingError(f"transformers refuses this config: {type(e).__name__}: {text[:300]}") from None
    cfg = _map_config(hf, model_type)
    problems = model_problems(cfg)
    problems = problems or size_problems(cfg)
    if problems:
        raise HFMappingError("; ".join(_in_hf_names(problems, model_type)))
    return cfg


def _map_config(hf: Any, model_type: str) -> ModelConfig:
    if model_type == "gpt2":
        if _get(hf, "scale_attn_by_inverse_layer_idx", False) or _get(hf, "reorder_and_upcast_attn", False):
            raise HFMappingError("GPT-2 variants with scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn "
                                 "are not supported")
        act = _get(hf, "activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise HFMappingError(f"GPT-2 activation_function {act!r} is not supported (gelu_new only)")
        d, n_heads = _get(hf, "n_embd"), _get(hf, "n_head")
        return ModelConfig(
            arch="gpt2", vocab_size=_get(hf, "vocab_size"), d_model=d, n_layers=_get(hf, "n_layer"),
            n_heads=n_heads, n_kv_heads=n_heads, ffn_hidden=_get(hf, "n_inner") or _times(4, d),
            max_seq_len=_get(hf, "n_positions"), norm_eps=_get(hf, "layer_norm_epsilon", 1e-5),
            norm="layernorm", norm_bias=True, mlp="gelu", pos_emb="learned", attn_bias=True, mlp_bias=True,
            tie_embeddings=bool(_get(hf, "tie_word_embeddings", True)), init_std=_get(hf, "initializer_range", 0.02),
        )
    rp = _get(hf, "rope_parameters") or _get(hf, "rope_scaling")
    if isinstance(rp, dict) and rp.get("rope_type", rp.get("type", "default")) not in ("default", None):
        raise HFMappingError(f"RoPE scaling {rp.get('rope_type', rp.get('type'))!r} is not supported")
    theta = rp["rope_theta"] if isinstance(rp, dict) and "rope_theta" in rp else _get(hf, "rope_theta", 10000.0)
    if type_problem(theta, float):
        raise HFMappingError(f"rope_theta: {type_problem(theta, float)}")
    n_heads = _get(hf, "num_attention_heads")
    d = _get(hf, "hidden_size")
    per_head = d // n_heads if _positive_ints(d, n_heads) else None  # a zero or missing count: named below
    head_dim = _get(hf, "head_dim") or per_head
    moe: dict[str, Any] = {}
    if model_type == "qwen3_moe":
        if _get(hf, "decoder_sparse_step", 1) != 1 or _get(hf, "mlp_only_layers", []):
            raise HFMappingError("Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
                                 "is not supported")
        top_k, coef = _get(hf, "num_experts_per_tok"), _get(hf, "router_aux_loss_coef", 0.001)
        if type_problem(coef, float):
            raise HFMappingError(f"router_aux_loss_coef: {type_problem(coef, float)}")
        moe = dict(n_experts=_get(hf, "num_experts"), moe_top_k=top_k, moe_ffn_hidden=_get(hf, "moe_intermediate_size"),
                   moe_norm_topk_prob=bool(_get(hf, "norm_topk_prob", True)),
                   moe_aux_loss_coef=float(coef) * top_k if _positive_ints(top_k) else float(coef))
    if _get(hf, "use_sliding_window", False):
        raise HFMappingError(f"{model_type} with use_sliding_window=true is not supported")
    return ModelConfig(
        arch=model_type,  # type: ignore[arg-type]  # one of FAMILIES: _config_from_hf checked
        vocab_size=_get(hf, "vocab_size"),
        d_model=d,
        n_layers=_get(hf, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=_get(hf, "num_key_value_heads") or n_heads,
        head_dim=None if head_dim == per_head else head_dim,
        ffn_hidden=_get(hf, "intermediate_size"),
        max_seq_len=_get(hf, "max_position_embeddings"),
        rope_theta=float(theta),
        norm_eps=_get(hf, "rms_norm_eps", 1e-6),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        attn_bias=bool(_get(hf, "attention_bias", False)),
        mlp_bias=bool(_get(hf, "mlp_bias", False)),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
        init_std=_get(hf, "initializer_range", 0.02),
        **moe,
    )


def _positive_ints(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def _times(k: int, d: Any) -> Any:
    """``k * d`` for a positive integer ``d``; ``d`` itself otherwise (its problem is named by the checks)."""
    return k * d if _positive_ints(d) else d


# --------------------------------------------------------------------------- weights

def to_hf_state_dict(model: Transformer, moe_layout: str = "fused") -> dict[str, torch.Tensor]:
    """Our model's weights under HF names, projections split. Every tensor has its own storage
    except a tied ``lm_head.weight``, which IS the embedding (drop it before a safetensors save).

    ``moe_layout``: ``fused`` (transformers 5.x modules' own 3-D expert tensors, for
    ``load_state_dict`` into a live model) or ``per_expert`` (``experts.{e}.gate_proj.weight``
    ..., what ``save_pretrained`` writes and every transformers version reads from files)."""
    cfg: ModelConfig = model.cfg
    check_exportable(cfg)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = _to_hf(sd, cfg, moe_layout)
    head = sd["tok_emb.weight"] if cfg.tie_embeddings else sd["lm_head.weight"]
    return {k: (v if v is head else v.contiguous().clone()) for k, v in {**out, "lm_head.weight": head}.items()}


# A rule (ours, HF keys, split sizes, transposed) maps one of our tensors to one or more HF
# tensors: ours is the HF ones concatenated on dim 0 in that order (``sizes`` None: one
# tensor); ``transposed``: HF stores it as (in, out) (GPT-2's Conv1D). The same rules serve
# both directions, so export and import cannot drift apart.
Rule = tuple[str, tuple[str, ...], "list[int] | None", bool]


def _llama_rules(cfg: ModelConfig) -> list[Rule]:
    """Every dense tensor of the Llama / Qwen3 / Qwen3-MoE families (MoE blocks: ``_moe_*``)."""
    hd, F_ = cfg.resolved_head_dim, cfg.ffn_hidden
    qkv_split = [cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd]
    rules: list[Rule] = [("tok_emb.weight", ("model.embed_tokens.weight",), None, False),
                         ("norm.weight", ("model.norm.weight",), None, False)]
    for i in range(cfg.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        rules.append((p + "attn_norm.weight", (h + "input_layernorm.weight",), None, False))
        for kind in ("weight", "bias") if cfg.attn_bias else ("weight",):
            rules.append((p + f"attn.wqkv.{kind}", tuple(h + f"self_attn.{x}_proj.{kind}" for x in "qkv"),
                          qkv_split, False))  # ((H + 2*KV) * hd, D)
            rules.append((p + f"attn.wo.{kind}", (h + f"self_attn.o_proj.{kind}",), None, False))
        if cfg.qk_norm:
            rules.append((p + "attn.q_norm.weight", (h + "self_attn.q_norm.weight",), None, False))
            rules.append((p + "attn.k_norm.weight", (h + "self_attn.k_norm.weight",), None, False))
        rules.append((p + "mlp_norm.weight", (h + "post_attention_layernorm.weight",), None, False))
        if cfg.is_moe:
            continue
        for kind in ("weight", "bias") if cfg.mlp_bias else ("weight",):
            rules.append((p + f"mlp.w_gate_up.{kind}", (h + f"mlp.gate_proj.{kind}", h + f"mlp.up_proj.{kind}"),
                          [F_, F_], False))  # (2F, D)
            rules.append((p + f"mlp.w_down.{kind}", (h + f"mlp.down_proj.{kind}",), None, False))
    return rules


# (ours, HF, transposed) per GPT-2 layer; Conv1D keeps weights as (in, out).
_GPT2_LAYER = (
    ("attn_norm.weight", "ln_1.weight", False), ("attn_norm.bias", "ln_1.bias", False),
    ("attn.wqkv.weight", "attn.c_attn.weight", True), ("attn.wqkv.bias", "attn.c_attn.bias", False),
    ("attn.wo.weight", "attn.c_proj.weight", True), ("attn.wo.bias", "attn.c_proj.bias", False),
    ("mlp_norm.weight", "ln_2.weight", False), ("mlp_norm.bias", "ln_2.bias", False),
    ("mlp.w_up.weight", "mlp.c_fc.weight", True), ("mlp.w_up.bias", "mlp.c_fc.bias", False),
    ("mlp.w_down.weight", "mlp.c_proj.weight", True), ("mlp.w_down.bias", "mlp.c_proj.bias", False),
)


def _gpt2_rules(cfg: ModelConfig) -> list[Rule]:
    rules: list[Rule] = [(ours, (theirs,), None, False) for ours, theirs in (
        ("tok_emb.weight", "transformer.wte.weight"), ("pos_emb.weight", "transformer.wpe.weight"),
        ("norm.weight", "transformer.ln_f.weight"), ("norm.bias", "transformer.ln_f.bias"))]
    for i in range(cfg.n_layers):
        rules += [(f"layers.{i}.{ours}", (f"transformer.h.{i}.{theirs}",), None, t) for ours, theirs, t in _GPT2_LAYER]
    return rules


def _rules(cfg: ModelConfig) -> list[Rule]:
    return _gpt2_rules(cfg) if cfg.arch == "gpt2" else _llama_rules(cfg)


def _moe_layers(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our prefix, HF prefix) of each MoE block's ``mlp.``."""
    return [(f"layers.{i}.mlp.", f"model.layers.{i}.mlp.") for i in range(cfg.n_layers)] if cfg.is_moe else []


def _to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig, moe_layout: str = "fused") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for ours, theirs, sizes, transposed in _rules(cfg):
        w = sd[ours].t() if transposed else sd[ours]
        out.update(zip(theirs, w.split(sizes, dim=0) if sizes else (w,)))
    if _moe_layers(cfg):
        for p, h in _moe_layers(cfg):
            mlp = {k[len(p):]: v for k, v in sd.items() if k.startswith(p)}
            out.update({h + k: v for k, v in moe_to_hf(mlp, layout=moe_layout).items()})
    return out


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """An HF state dict of ``cfg``'s family -> a state dict for ``Transformer(cfg)`` (strict load).

    A tied config takes the embedding and ignores ``lm_head.weight``; an untied one
    requires it. A missing tensor raises ``KeyError`` naming the HF key.
    """
    check_exportable(cfg)
    out: dict[str, torch.Tensor] = {}
    for ours, theirs, sizes, transposed in _rules(cfg):
        w = torch.cat([sd[t] for t in theirs], dim=0) if sizes else sd[theirs[0]]
        out[ours] = w.t().contiguous() if transposed else w
    if _moe_layers(cfg):
        for p, h in _moe_layers(cfg):
            mlp = {k[len(h):]: v for k, v in sd.items() if k.startswith(h)}
            out.update({p + k: v for k, v in moe_from_hf(mlp, cfg.n_experts).items()})
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def to_hf_model(model: Transformer, attn_implementation: str = "sdpa") -> Any:
    """A ``transformers`` causal LM with our model's weights (in our weights' dtype), in eval mode."""
    AutoModelForCausalLM = deps.load("transformers", "a Hugging Face model").AutoModelForCausalLM

    # Built on the CPU (not meta): HF's rotary inv_freq is a non-persistent buffer that
    # a state dict would not fill.
    hf = AutoModelForCausalLM.from_config(hf_config(model.cfg), attn_implementation=attn_implementation)
    hf.to(model.tok_emb.weight.dtype)
    result = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    missing = [k for k in result.missing_keys if not (model.cfg.tie_embeddings and k == "lm_head.weight")]
    unexpected = [k for k in result.unexpected_keys if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    return hf.eval()
