"""Generation: the key/value cache gives the same logits and tokens as recomputing, seeds are
deterministic, top-k/top-p restrict what can be drawn."""

import pytest
import torch

from flopwise.config import ModelConfig
from flopwise.evaluate.generate import Sampling, _pick, generate
from flopwise.model import build_model

CONFIGS = {
    "llama-gqa": dict(arch="llama", n_kv_heads=2),
    "qwen3-mqa": dict(arch="qwen3", qk_norm=True, n_kv_heads=1),
    "gpt2": dict(arch="gpt2", norm="layernorm", norm_bias=True, mlp="gelu", pos_emb="learned", attn_bias=True,
                 mlp_bias=True, n_kv_heads=4),
    "moe": dict(arch="qwen3_moe", qk_norm=True, n_experts=4, moe_top_k=2, moe_ffn_hidden=16),
}


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=96, d_model=32, n_layers=2, n_heads=4, ffn_hidden=48, max_seq_len=40), **kw})


@pytest.mark.parametrize("name", CONFIGS)
def test_cache_logits_equal_full_recompute(name):
    model = build_model(tiny(**CONFIGS[name]), seed=1).eval()
    idx = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(idx)  # (2, 17, V)
        cache = model.new_cache(2)
        parts = [model(idx[:, :9], cache=cache)]  # a prompt, then one token at a time, then a chunk of 3
        parts += [model(idx[:, t : t + 1], cache=cache) for t in range(9, 14)]
        parts.append(model(idx[:, 14:], cache=cache))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_generation_is_the_same_with_and_without_the_cache(name):
    model = build_model(tiny(**CONFIGS[name]), seed=2)
    prompt = torch.randint(0, 96, (3, 5), generator=torch.Generator().manual_seed(1))
    a = generate(model, prompt, 50, 40, Sampling(temperature=0))  # runs past max_seq_len: the cache hands over
    b = generate(model, prompt, 50, 40, Sampling(temperature=0), use_cache=False)
    assert a.shape == (3, 55) and torch.equal(a, b)


def test_sampling_is_deterministic_given_a_seed():
    model = build_model(tiny(), seed=3)
    prompt = torch.randint(0, 96, (2, 4), generator=torch.Generator().manual_seed(2))

    def run(seed):
        return generate(model, prompt, 20, 40, Sampling(temperature=1.0, top_k=20, top_p=0.9,
                                                  generator=torch.Generator().manual_seed(seed)))

    assert torch.equal(run(7), run(7)) and not torch.equal(run(7), run(8))


def test_top_k_and_top_p_restrict_the_candidates():
    logits = torch.tensor([[4.0, 3.0, 2.0, -5.0, -5.0]])
    g = torch.Generator().manual_seed(0)
    drawn = {int(_pick(logits, Sampling(temperature=1.0, top_k=2, generator=g))) for _ in range(200)}
    assert drawn == {0, 1}
    # probabilities ~ [0.665, 0.245, 0.090, ...]: top_p 0.8 keeps the first two, 0.5 only the first
    drawn = {int(_pick(logits, Sampling(temperature=1.0, top_p=0.8, generator=g))) for _ in range(200)}
    assert drawn == {0, 1}
    assert {int(_pick(logits, Sampling(temperature=1.0, top_p=0.5, generator=g))) for _ in range(50)} == {0}


def test_eos_stops_every_row():
    model = build_model(tiny(), seed=4)
    prompt = torch.zeros(1, 3, dtype=torch.long)
    first = int(generate(model, prompt, 1, 40, Sampling(temperature=0))[0, -1])
    out = generate(model, prompt, 30, 40, Sampling(temperature=0), eos_id=first)
    assert out.shape[1] == 4  # stopped right after producing the EOS
