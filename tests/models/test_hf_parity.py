"""Our model equals transformers' LlamaForCausalLM with the same weights."""

import dataclasses

import pytest
import torch

from megatron_lc.models.llama import RopeScaling, build_model, get_config
from megatron_lc.models.llama.hf import from_hf_config, from_hf_state_dict, to_hf_config, to_hf_state_dict

transformers = pytest.importorskip("transformers")

CASES = {
    "gqa": ("debug", {}),
    "tied": ("debug-tied", {}),
    "rope-scaling": ("debug", {"rope_scaling": RopeScaling(factor=4.0, original_max_position_embeddings=64)}),
    "mha-wide-heads": ("debug", {"num_query_groups": 8, "kv_channels": 32}),
    # llama3-70b scaled down: its 64 heads over 8 kv heads, its ffn/hidden ratio (3.5) and its llama3 rope scaling
    # (factor 8, low 1, high 4, over 8192 original positions), 2 layers, head dim 8, a 512-token vocabulary.
    "llama3-70b-scaled": ("llama3-70b", {"hidden_size": 512, "num_layers": 2, "kv_channels": 8,
                                         "ffn_hidden_size": 1792, "vocab_size": 512}),
}


def _pair(case):
    name, overrides = CASES[case]
    config = dataclasses.replace(get_config(name), **overrides)
    ours = build_model(config, device="cpu", seed=7)
    theirs = transformers.LlamaForCausalLM(to_hf_config(config)).eval()
    theirs.load_state_dict(to_hf_state_dict(ours.state_dict(), config), strict=True)
    return config, ours, theirs


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_equal_transformers_in_fp32(case):
    config, ours, theirs = _pair(case)
    ids = torch.randint(0, config.vocab_size, (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours_logits, their_logits = ours(ids), theirs(ids).logits
    torch.testing.assert_close(ours_logits, their_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_through_transformers_is_exact(case):
    config, ours, theirs = _pair(case)
    assert from_hf_config(theirs.config) == config
    back = from_hf_state_dict(theirs.state_dict(), config)
    mine = ours.state_dict()
    assert back.keys() == mine.keys()
    for k in mine:
        assert torch.equal(back[k], mine[k]), k


def test_foreign_model_type_is_refused():
    config = to_hf_config(get_config("debug"))
    config.model_type = "mistral"
    with pytest.raises(ValueError, match="mistral"):
        from_hf_config(config)


# --- rotary scalings, exact against transformers' own frequencies -------------------------------------


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 128, "beta_fast": 16.0,
     "beta_slow": 2.0, "attention_factor": 1.3},
    {"rope_type": "dynamic", "factor": 4.0},
])
def test_each_rope_scaling_converts_both_ways_and_gives_transformers_logits(scaling, tmp_path):
    """The frequencies and the cos/sin factor of transformers' ROPE_INIT_FUNCTIONS, the logits of its model on
    positions past the original context, and the same dict back on export."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_lc.attention.rotary import rope_inv_freq
    from megatron_lc.models.llama.hf import from_hf_config, hf_rope_scaling

    dynamic = scaling["rope_type"] == "dynamic"  # scaled once the sequence passes max_position_embeddings
    hf_config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                                         max_position_embeddings=128 if dynamic else 512, rope_scaling=dict(scaling))
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(hf_config).eval()
    ours_config = from_hf_config(hf_config)
    want_freq, want_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, torch.device("cpu"), seq_len=300)
    got = rope_inv_freq(ours_config.kv_channels, ours_config.rotary_base, ours_config.rope_scaling, seq_length=300,
                        max_positions=ours_config.max_position_embeddings)
    torch.testing.assert_close(got, want_freq.float(), rtol=1e-6, atol=0)
    assert ours_config.rope_scaling.cos_sin_factor() == pytest.approx(want_factor, rel=1e-12)
    defaults = {"beta_fast": 32.0, "beta_slow": 1.0} if scaling["rope_type"] == "yarn" else {}
    assert hf_rope_scaling(ours_config) == {**defaults, **scaling}  # transformers' defaults written out
    ours = build_model(ours_config, device="cpu", seed=None).eval()
    ours.load_state_dict(from_hf_state_dict(theirs.state_dict(), ours_config))
    ids = torch.randint(0, 512, (1, 300), generator=torch.Generator().manual_seed(3))  # past 64/128 positions
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=1e-5, atol=1e-5)



def test_llama3_70b_exports_llama_3_1_70b_config():
    """The fields of meta-llama/Llama-3.1-70B's config.json that fix the model, as an export writes them."""
    from megatron_lc.training.hf_conversion import loader_compatible_fields

    config = get_config("llama3-70b")
    hf = to_hf_config(config)
    written = {**hf.to_dict(), **loader_compatible_fields(config)}
    published = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
                 "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                 "max_position_embeddings": 131072, "tie_word_embeddings": False,
                 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    assert {k: written[k] for k in published} == published
    assert from_hf_config(hf) == config
