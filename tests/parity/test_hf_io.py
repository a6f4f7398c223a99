"""Models in and out through files: `flopwise export --format hf` read back by transformers'
`from_pretrained`, Hugging Face directories read by `flopwise.load` and `model.hf_config`, and
`flopwise.load` on run and checkpoint directories. CPU, float32, tiny models."""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from test_hf_parity import CONFIGS, randomize, tokens  # noqa: E402  (same folder, on sys.path)
from transformers import AutoModelForCausalLM  # noqa: E402

import flopwise  # noqa: E402
from flopwise.cli import main as cli_main  # noqa: E402
from flopwise.config import RunConfig, build_config  # noqa: E402
from flopwise.data.tokenizer import train_bpe  # noqa: E402
from flopwise.model import build_model  # noqa: E402
from flopwise.model.hf import hf_config, read_hf_config  # noqa: E402
from flopwise.train.checkpoint import save_checkpoint  # noqa: E402

FAMILIES = ["llama-untied", "qwen3-hd24-tied", "gpt2-tied", "qwen3-moe"]


def valid_run(model) -> RunConfig:
    cfg = RunConfig(model=model)
    cfg.train.seq_len, cfg.train.max_steps, cfg.data.builtin_vocab_size = 32, 5, 300
    return cfg


def make_run(tmp_path, name: str, seed: int = 11):
    """A run directory as the trainer leaves it: config.yaml, tokenizer.json, one checkpoint."""
    cfg = valid_run(dataclasses.replace(CONFIGS[name], vocab_size=320))  # room for a real BPE
    run = tmp_path / "run"
    model = build_model(cfg.model, seed=seed).eval()
    randomize(model, seed=seed)
    run.mkdir()
    tok = train_bpe(["def f(x):\n    return x + 1\n" * 30], 300)
    tok.save(str(run / "tokenizer.json"))
    (run / "config.yaml").write_text(cfg.to_yaml())
    ckpt = save_checkpoint(run, 5, model, None, {"tokens": 0}, cfg.to_yaml())
    return run, ckpt, model


@pytest.mark.parametrize("name", FAMILIES)
def test_export_loads_with_from_pretrained(tmp_path, name):
    run, _, ours = make_run(tmp_path, name)
    out = tmp_path / "hf"
    assert cli_main(["export", str(run), str(out), "--format", "hf"]) == 0
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    idx = tokens(ours.cfg)
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), rtol=1e-5, atol=1e-5)
    # And the tokenizer comes along, usable by transformers.
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("def f").input_ids and tok.eos_token is not None


def test_export_refuses_a_custom_model_and_writes_nothing(tmp_path, capsys):
    run, _, _ = make_run(tmp_path, "llama-untied")
    cfg = valid_run(dataclasses.replace(CONFIGS["llama-untied"], arch="custom", mlp="relu2", vocab_size=320))
    model = build_model(cfg.model)
    ckpt = save_checkpoint(run, 9, model, None, {"tokens": 0}, cfg.to_yaml())
    out = tmp_path / "hf"
    assert cli_main(["export", str(ckpt), str(out)]) == 2
    assert "no Hugging Face equivalent" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".hf*"))


def test_export_does_not_overwrite_without_the_flag(tmp_path, capsys):
    run, _, _ = make_run(tmp_path, "llama-untied")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli_main(["export", str(run), str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    assert cli_main(["export", str(run), str(out), "--overwrite"]) == 0
    assert (out / "model.safetensors").is_file() and not (out / "keep.txt").exists()


def test_export_takes_out_as_a_flag_too_but_only_once(tmp_path, capsys):
    run, _, _ = make_run(tmp_path, "llama-untied")
    assert cli_main(["export", str(run), "--out", str(tmp_path / "flag")]) == 0  # as prepare and preflight spell it
    assert (tmp_path / "flag" / "model.safetensors").is_file()
    for args in ([], [str(tmp_path / "a"), "--out", str(tmp_path / "b")]):
        assert cli_main(["export", str(run), *args]) == 2
        assert "give the directory to write once" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("name", FAMILIES)
def test_load_a_hugging_face_directory(tmp_path, name):
    cfg = CONFIGS[name]
    hf = AutoModelForCausalLM.from_config(hf_config(cfg)).eval()
    randomize(hf, seed=12)
    hf.save_pretrained(tmp_path / "pub")
    model, tokenizer = flopwise.load(tmp_path / "pub")
    assert tokenizer is None and not model.training
    idx = tokens(cfg)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, rtol=1e-5, atol=1e-5)


def test_load_run_and_checkpoint_directories(tmp_path):
    run, ckpt, ours = make_run(tmp_path, "qwen3-hd24-tied")
    idx = tokens(ours.cfg)
    for path in (run, ckpt):
        model, tok = flopwise.load(path)
        assert tok is not None and tok.get_vocab_size() <= ours.cfg.vocab_size
        with torch.no_grad():
            torch.testing.assert_close(model(idx), ours(idx), rtol=0, atol=0)
    with pytest.raises(ValueError, match="neither model.pt"):
        flopwise.load(tmp_path)


def test_hf_config_gives_the_architecture_and_the_weights_for_training(tmp_path):
    cfg = CONFIGS["qwen3-hd24-untied"]
    hf = AutoModelForCausalLM.from_config(hf_config(cfg)).eval()
    randomize(hf, seed=13)
    hf.save_pretrained(tmp_path / "pub")
    run_cfg = build_config(overrides=[f"model.hf_config={tmp_path / 'pub'}", "model.attention=eager",
                                      "train.seq_len=32", "data.builtin_vocab_size=256"], read_hf_config=read_hf_config)
    m = run_cfg.model
    assert (m.arch, m.d_model, m.head_dim, m.qk_norm, m.tie_embeddings, m.attention) == ("qwen3", 64, 24, True, False,
                                                                                           "eager")
    from flopwise.train.setup import load_hf_init

    model = build_model(m)
    assert "weights from" in load_hf_init(model, m.hf_config)
    idx = tokens(cfg)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(idx), hf(idx).logits, rtol=1e-5, atol=1e-5)
    (tmp_path / "bad.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ValueError, match="model_type 'mamba' is not supported"):
        build_config(overrides=[f"model.hf_config={tmp_path / 'bad.json'}", "train.seq_len=32"],
                     read_hf_config=read_hf_config)
    with pytest.raises(ValueError, match="missing.json does not exist"):
        build_config(overrides=[f"model.hf_config={tmp_path / 'missing.json'}"], read_hf_config=read_hf_config)


# --------------------------------------------------------------------------- issue 19

def test_export_special_tokens_come_from_the_tokenizer(tmp_path):
    """A tokenizer without BOS gives bos_token_id null (not Llama's default 1, an ordinary
    token here); generate() then starts from EOS, as flopwise generate does. With a BOS
    token, its id is exported and generate() needs no input."""
    run, _, _ = make_run(tmp_path, "llama-untied")
    out = tmp_path / "hf"
    assert cli_main(["export", str(run), str(out)]) == 0
    eos = flopwise.load(run)[1].token_to_id("<|endoftext|>")
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((out / name).read_text())
        assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (None, eos, None), name
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    gen = hf.generate(torch.tensor([[eos]]), max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, 5) and gen[0, 0] == eos
    with pytest.raises(ValueError, match="bos_token_id"):  # no BOS: transformers asks for a prompt
        hf.generate(max_new_tokens=4, do_sample=False)

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    tok.add_special_tokens(["<|begin_of_text|>", "<pad>"])
    tok.save(str(run / "tokenizer.json"))
    bos, pad = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<pad>")
    assert cli_main(["export", str(run), str(out), "--overwrite"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (bos, eos, pad)
    assert json.loads((out / "tokenizer_config.json").read_text())["bos_token"] == "<|begin_of_text|>"
    gen = AutoModelForCausalLM.from_pretrained(out).eval().generate(max_new_tokens=3, do_sample=False)
    assert gen.shape == (1, 4) and gen[0, 0] == bos


def test_export_files_get_the_usual_mode(tmp_path):
    """Not the 0600 of safetensors' temporary file: 0666 & ~umask, like any new file."""
    import os

    run, _, _ = make_run(tmp_path, "gpt2-tied")
    old = os.umask(0o002)
    try:
        assert cli_main(["export", str(run), str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert modes["model.safetensors"] == 0o664 and set(modes.values()) == {0o664}, modes


def test_export_records_the_runs_validation_windows(tmp_path):
    run, _, _ = make_run(tmp_path, "qwen3-hd24-tied")
    out = tmp_path / "hf"
    assert cli_main(["export", str(run), str(out)]) == 0
    rec = json.loads((out / "flopwise.json").read_text())
    cfg = valid_run(CONFIGS["qwen3-hd24-tied"])
    assert rec["step"] == 5 and rec["validation"]["seq_len"] == 32
    assert rec["validation"]["windows"] == cfg.eval.windows
    assert rec["validation"]["data"]["builtin_vocab_size"] == 300
    AutoModelForCausalLM.from_pretrained(out)  # an extra file transformers ignores
