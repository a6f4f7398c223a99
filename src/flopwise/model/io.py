"""Models in and out: ``flopwise.load``, ``flopwise export --format hf`` and Hugging Face imports.

Three kinds of directory hold a model:

- a **run directory** (``config.yaml``, ``checkpoints/step-*/``, ``tokenizer.json``): its
  latest complete checkpoint is used;
- a **checkpoint directory** (``model.pt`` -- or ``sharded/``, written by FSDP2 ranks --,
  ``config.yaml``, ``state.json``);
- a **Hugging Face model directory** (``config.json`` and ``model.safetensors``, or a
  sharded ``model.safetensors.index.json``; ``tokenizer.json`` when present), of a family
  in :mod:`flopwise.model.hf`.

Exports are written into a hidden sibling directory and renamed into place when
complete, so an interrupted export never leaves a directory that looks loadable. Their
files get the usual mode of new files (``0666 & ~umask``), not a temporary file's 0600.

An HF export's special token ids (``bos_token_id``, ``eos_token_id``, ``pad_token_id`` in
``config.json`` and ``generation_config.json``) are the tokenizer's, ``null`` where it has
none (never a family's default: Llama's ``bos_token_id: 1`` is an ordinary token of most
BPEs). An export of a run also writes ``flopwise.json`` (:data:`EXPORT_RECORD`): the step,
and the run's validation geometry (the windows its checkpoint validated on -- ``eval.windows``
unless a resume kept an earlier count -- of ``train.seq_len`` tokens, the run's data section
and the data directory's fingerprint), so
``flopwise eval`` on the export measures the same held-out windows as on the run. A file
of its own rather than a key of ``config.json``: transformers never reads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from flopwise.checkpoints import (
    SHARDED,
    latest_checkpoint,
    load_checkpoint,
    read_state,
    unmarked_checkpoints,
    write_manifest,
)
from flopwise.config import ModelConfig, load_run_config
from flopwise.data.tokenizer import load_tokenizer, special_ids
from flopwise.errors import FlopwiseError
from flopwise.fsio import (
    FileFormatError,
    fsync_dir,
    is_write_fault,
    read_json,
    replace_dir,
    umask,
    write_error,
    write_json,
)
from flopwise.model.hf import (
    SPECIAL_KEYS,
    check_exportable,
    from_hf_state_dict,
    hf_config,
    read_hf_config,
    to_hf_state_dict,
)
from flopwise.model.transformer import Transformer, build_model, configure_attention
from flopwise.plan.flops import size_problems


class ModelSourceError(FlopwiseError, ValueError):
    """A path that holds no loadable model; the message says what was looked for."""


@dataclass
class ModelSource:
    kind: str  # run | checkpoint | hf
    path: Path  # the checkpoint directory for runs and checkpoints, the model directory for hf
    cfg: ModelConfig
    tokenizer_path: Path | None


def _find_tokenizer(*candidates: Path) -> Path | None:
    return next((p for p in candidates if p.is_file()), None)


def resolve(path: str | os.PathLike) -> ModelSource:
    """What ``path`` holds: a run, a checkpoint or a Hugging Face model directory."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelSourceError(f"{p}: no such directory "
                               f"(expected a run, a checkpoint or a Hugging Face model directory)")
    is_checkpoint = (p / "model.pt").is_file() or (p / SHARDED).is_dir()  # sharded: written by FSDP2 ranks
    if (p / "config.json").is_file() and not is_checkpoint:
        hf_cfg = read_hf_config(str(p / "config.json"))  # checked, the file named: before anything is allocated
        return ModelSource("hf", p, hf_cfg, _find_tokenizer(p / "tokenizer.json"))
    ckpt: Path | None
    if is_checkpoint:
        ckpt, run = p, p.parent.parent
        kind = "checkpoint"
    elif (p / "checkpoints").is_dir() or (p / "config.yaml").is_file():
        ckpt = latest_checkpoint(p)
        newer = [u for u in unmarked_checkpoints(p) if ckpt is None or int(u.name[5:]) > int(ckpt.name[5:])]
        if newer:  # taking an older step silently would evaluate (or export) another model than asked
            raise ModelSourceError(f"{newer[-1]}: the run's newest checkpoint has no COMPLETE marker, so it is not "
                                   f"loaded unverified; `flopwise checkpoint adopt {newer[-1]}` if you trust it, or "
                                   f"name an older checkpoint directory")
        if ckpt is None:
            raise ModelSourceError(f"{p}: a run directory without a complete checkpoint (checkpoints/step-*/)")
        run, kind = p, "run"
    else:
        raise ModelSourceError(f"{p}: holds neither model.pt (a checkpoint), checkpoints/ (a run) nor config.json "
                               "(a Hugging Face model)")
    cfg = load_run_config(ckpt / "config.yaml")
    too_large = size_problems(cfg.model)  # a config.yaml edited (or sent) with sizes no machine holds
    if too_large:
        raise ModelSourceError(f"{ckpt / 'config.yaml'}: {too_large[0]}")
    tok = _find_tokenizer(ckpt / "tokenizer.json", run / "tokenizer.json",
                          Path(cfg.data.path).expanduser() / "tokenizer.json" if cfg.data.path
                          else Path("/nonexistent"))
    return ModelSource(kind, ckpt, cfg.model, tok)


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards a ``model.safetensors.index.json`` names."""
    single = path / "model.safetensors"
    if single.is_file():
        return load_file(str(single))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            data = read_json(index)
        except FileFormatError as e:
            raise ModelSourceError(str(e)) from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelSourceError(f"{index}: no 'weight_map' of tensor name -> file name")
        shards = sorted(set(weight_map.values()))
        inside = path.resolve()  # a directory a user was sent is read only inside itself, links followed
        outside = [s for s in shards if Path(s).is_absolute() or not (path / s).resolve().is_relative_to(inside)]
        if outside:
            raise ModelSourceError(f"{index}: names a file outside {path}: {outside[0]!r}")
        sd: dict[str, torch.Tensor] = {}
        for shard in shards:
            sd.update(load_file(str(path / shard)))
        return sd
    raise ModelSourceError(f"{path}: no model.safetensors or model.safetensors.index.json")


def load_hf_weights(model: Transformer, path: Path) -> None:
    """Load a Hugging Face directory's safetensors into ``model`` (strict: every tensor must fit)."""
    sd = read_safetensors_dir(path)
    try:
        ours = from_hf_state_dict(sd, model.cfg)
    except KeyError as e:
        raise ModelSourceError(f"{path}: the weights lack {e.args[0]!r} for this configuration") from None
    dtype = model.tok_emb.weight.dtype
    model.load_state_dict({k: v.to(dtype) for k, v in ours.items()}, strict=True)


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> tuple[Transformer, ModelSource]:
    """The model stored at ``path`` (run, checkpoint or HF directory), in eval mode."""
    src = resolve(path)
    device = torch.device(device)
    model = build_model(src.cfg, device=device)
    if src.kind == "hf":
        load_hf_weights(model, src.path)
    else:
        # Verified first (a corrupted file is named, not loaded); a sharded checkpoint is
        # consolidated here, in this one process, whatever number of ranks wrote it.
        load_checkpoint(src.path, model, map_location=device)
    if dtype is not None:
        model.to(dtype)
        configure_attention(model, device, dtype)
    return model.eval(), src


def load(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """``(model, tokenizer)`` from a run directory, a checkpoint directory or a Hugging Face
    model directory. The model is a ``torch.nn.Module`` in eval mode: ``model(input_ids)``
    with ``input_ids`` (B, T) int64 returns logits (B, T, vocab). The tokenizer is a
    ``tokenizers.Tokenizer`` (None when the directory has no ``tokenizer.json``)."""
    model, src = load_model(path, device, dtype)
    tokenizer = None
    if src.tokenizer_path is not None:
        tokenizer = load_tokenizer(src.tokenizer_path)  # a malformed file: an error naming it
    return model, tokenizer


# --------------------------------------------------------------------------- export

EXPORT_RECORD = "flopwise.json"  # what flopwise knows about an export that transformers does not
PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>", "<|finetune_right_pad_id|>")


def _special_tokens(tokenizer_path: Path | None) -> dict[str, Any]:
    """``{bos,eos,pad}_token_id`` (None where the tokenizer has no such token) and, for those
    it has, ``{bos,eos,pad}_token`` (the strings, for ``tokenizer_config.json``)."""
    if tokenizer_path is None:
        return {}
    tok = load_tokenizer(tokenizer_path)
    ids = special_ids(tok)
    specials = {t.content: int(i) for i, t in tok.get_added_tokens_decoder().items() if t.special}
    ids["pad_id"] = next((specials[t] for t in PAD_CANDIDATES if t in specials), None)
    out: dict[str, Any] = {}
    for name in ("bos", "eos", "pad"):
        i = ids.get(f"{name}_id")
        out[f"{name}_token_id"] = i
        if i is not None:
            out[f"{name}_token"] = tok.id_to_token(i)
    return out


def _source_special_ids(src: ModelSource) -> dict[str, Any]:
    """Without a tokenizer: a Hugging Face source's own ids, else None for each (unknown)."""
    if src.kind == "hf":
        hf = read_json(src.path / "config.json")  # read (and checked) by resolve() already
        return {k: hf.get(k) for k in SPECIAL_KEYS}
    return dict.fromkeys(SPECIAL_KEYS)


def _export_record(src: ModelSource) -> dict[str, Any] | None:
    """``flopwise.json`` of an export of a run or checkpoint: where it came from and the run's
    validation geometry (None for a Hugging Face source, which has no run)."""
    if src.kind == "hf":
        return None
    cfg = load_run_config(src.path / "config.yaml")
    try:
        state = read_json(src.path / "state.json")
    except (OSError, ValueError):
        state = {}
    if not isinstance(state, dict):
        state = {}
    fingerprint = state.get("data_fingerprint")  # what the run trained on: its data directory or the embedded corpus
    if not isinstance(fingerprint, str):
        fingerprint = None
    if fingerprint is None and cfg.data.path:  # a checkpoint from before state.json recorded it
        with contextlib.suppress(OSError, ValueError, AttributeError):
            fingerprint = read_json(Path(cfg.data.path).expanduser() / "meta.json").get("fingerprint")
    windows = state.get("val_windows")  # the set the run validated on: a resume keeps its first count
    if isinstance(windows, bool) or not isinstance(windows, int) or windows <= 0:
        windows = cfg.eval.windows
    return {
        "format": 1,
        "exported_from": str(src.path),
        "step": state.get("step"),
        "tokens": state.get("tokens"),
        "validation": {  # no micro-batch: a speed setting, not part of the set
            "windows": windows,
            "seq_len": cfg.train.seq_len,
            "data": dataclasses.asdict(cfg.data),
            "data_fingerprint": fingerprint,
        },
    }


def read_export_record(path: str | os.PathLike) -> dict[str, Any] | None:
    """The ``flopwise.json`` of a Hugging Face directory flopwise exported (None when absent
    or unreadable: a directory from elsewhere)."""
    try:
        rec = read_json(Path(path) / EXPORT_RECORD)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _file_mode() -> int:
    """The mode ``open()`` gives a new file: 0666 minus the process umask."""
    return 0o666 & ~umask()


def export_hf(path: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False,
              log=print) -> Path:
    """Write ``out/`` loadable by ``transformers.AutoModelForCausalLM.from_pretrained``:
    ``config.json``, ``model.safetensors``, ``generation_config.json``, ``flopwise.json``
    (a run's or checkpoint's step and validation geometry) and, when the run has one,
    ``tokenizer.json`` with ``tokenizer_config.json`` (bos/eos/pad tokens it has). Special
    token ids come from the tokenizer (None where it has no such token)."""

    src = resolve(path)
    check_exportable(src.cfg)  # before any work: a custom model is refused with the reason
    out = _check_out(out, overwrite)
    model, _ = load_model(src.path)
    with _published(out) as tmp:
        special = _special_tokens(src.tokenizer_path) or _source_special_ids(src)
        hf_cfg = hf_config(model.cfg, special)  # the tokenizer's ids, never the family's defaults
        hf_cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                 "qwen3_moe": "Qwen3MoeForCausalLM", "gpt2": "GPT2LMHeadModel"}[model.cfg.arch]]
        # transformers 5 names it dtype (torch_dtype is deprecated there); 4.x torch_dtype.
        setattr(hf_cfg, "dtype" if "dtype" in hf_cfg.to_dict() else "torch_dtype", "float32")
        hf_cfg.save_pretrained(str(tmp))
        sd = to_hf_state_dict(model, moe_layout="per_expert")  # the file layout every transformers reads
        if model.cfg.tie_embeddings:
            sd.pop("lm_head.weight")  # the same tensor as the embedding; transformers re-ties it
        save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        gen = {k: special[k] for k in SPECIAL_KEYS}
        write_json(tmp / "generation_config.json", {**gen, "_from_model_config": True})
        record = _export_record(src)
        if record is not None:
            write_json(tmp / EXPORT_RECORD, record)
        if src.tokenizer_path is not None:
            shutil.copyfile(src.tokenizer_path, tmp / "tokenizer.json")
            tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.cfg.max_seq_len,
                       **{k: v for k, v in special.items() if not k.endswith("_id")}}
            write_json(tmp / "tokenizer_config.json", tok_cfg)
        mode = _file_mode()  # safetensors writes through a 0600 temporary file
        for f in tmp.iterdir():
            f.chmod(mode)
    n = sum(p.numel() for p in model.parameters())
    log(f"export: {src.kind} {src.path} -> {out} ({model.cfg.arch}, {n:,} parameters, float32"
        f"{', tokenizer' if src.tokenizer_path else ', no tokenizer found'})")
    return out


def export_consolidated(path: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False,
                        log=print) -> Path:
    """Write ``out/`` as a one-file flopwise checkpoint: ``model.pt`` (every weight, whatever
    number of ranks wrote the source's shards), ``config.yaml``, ``state.json`` and the
    tokenizer. ``flopwise.load(out)`` and ``torch.load(out / "model.pt")`` read it; unlike
    ``--format hf`` it takes any architecture, custom ones included."""
    src = resolve(path)
    if src.kind == "hf":
        raise ModelSourceError(f"{src.path}: already a Hugging Face directory; --format pt exports flopwise runs")
    out = _check_out(out, overwrite)
    model, _ = load_model(src.path)  # verified
    state = read_state(src.path)
    with _published(out) as tmp:
        torch.save(model.state_dict(), tmp / "model.pt")
        shutil.copyfile(src.path / "config.yaml", tmp / "config.yaml")
        write_json(tmp / "state.json", {"step": state.get("step"), "tokens": state.get("tokens"),
                                        "consolidated_from": str(src.path)})
        if src.tokenizer_path is not None:
            shutil.copyfile(src.tokenizer_path, tmp / "tokenizer.json")
        write_manifest(tmp, exported=True)  # loaded like any checkpoint: verified against its manifest first
    n = sum(p.numel() for p in model.parameters())
    log(f"export: {src.kind} {src.path} -> {out / 'model.pt'} (one file, {n:,} parameters, float32"
        f"{', tokenizer' if src.tokenizer_path else ', no tokenizer found'})")
    return out


def _check_out(out: str | os.PathLike, overwrite: bool) -> Path:
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise ModelSourceError(f"{out}: exists and is a file, not a directory; name a directory to export into")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ModelSourceError(f"{out}: exists and is not empty; pass --overwrite to replace it")
    return out


@contextlib.contextmanager
def _published(out: Path):
    """A hidden sibling directory to write into, renamed to ``out`` when the block succeeds
    (removed when it fails): an interrupted export never looks loadable. An existing ``out``
    (``--overwrite``) is replaced only by a complete export: moved aside, the new one renamed
    in, then deleted -- a failure at any point (a full disk while writing, a read-only folder)
    leaves it as it was and raises a :class:`WriteError` naming ``out``."""
    tmp = out.parent / f".{out.name}.partial"
    kept = f"{out} was left as it was" if out.exists() else f"nothing was left at {out}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # an interrupted export's
        tmp.mkdir(parents=True)
        yield tmp
        replace_dir(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and is_write_fault(e):
            raise write_error(out, e, "the export", kept) from e
        raise
    with contextlib.suppress(OSError):  # the rename is made; its durability is best effort
        fsync_dir(out.parent)

