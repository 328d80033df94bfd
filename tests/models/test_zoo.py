import subprocess
import sys

import pytest

from megatron_lc.models.llama import FLAVOURS, build_model, count_parameters, get_config

PUBLISHED_COUNTS = {
    "llama3-3b": 3_212_749_824,
    "llama3-8b": 8_030_261_248,
    "llama-32b": 32_519_623_680,
    "llama3-70b": 70_553_706_496,  # Llama-3.1-70B's safetensors index total_size / 2 (bf16)
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_COUNTS))
def test_flavour_parameter_count_matches_published_model(name):
    model = build_model(FLAVOURS[name], device="meta")
    assert count_parameters(model) == PUBLISHED_COUNTS[name]


def test_models_list_prints_every_flavour_with_its_count():
    out = subprocess.run([sys.executable, "-m", "megatron_lc.models", "--list"], check=True,
                         capture_output=True, text=True).stdout
    for name, count in PUBLISHED_COUNTS.items():
        assert name in out and f"{count:,}" in out
    assert "debug" in out


def test_unknown_flavour_is_named_in_the_error():
    with pytest.raises(ValueError, match="llama-7t"):
        get_config("llama-7t")


@pytest.mark.parametrize("overrides, message", [
    ({"num_attention_heads": 6, "num_query_groups": 4}, "divisible by num_query_groups"),
    ({"kv_channels": 15}, "kv_channels must be even"),
    ({"hidden_size": 0}, "hidden_size must be positive"),
])
def test_impossible_shapes_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        get_config("debug", **overrides)


def test_meta_model_materialises_with_seeded_weights_and_tied_embeddings():
    a = build_model(get_config("debug-tied"), device="cpu", seed=3)
    b = build_model(get_config("debug-tied"), device="cpu", seed=3)
    assert a.head.lm_head.weight is a.embed_tokens.weight
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert p.device.type == "cpu" and (p == q).all(), n


def test_kv_channels_follow_hidden_size_and_heads_unless_given():
    from megatron_lc.models.llama import get_config

    assert get_config("debug", hidden_size=128, num_attention_heads=4).kv_channels == 32
    assert get_config("llama3-8b", num_attention_heads=16).kv_channels == 256
    assert get_config("debug", hidden_size=128, kv_channels=8).kv_channels == 8
    assert get_config("debug", num_layers=1).kv_channels == 16  # the flavour's own


def test_llama3_70b_is_llama_3_1_70b_with_its_rope_scaling():
    c = get_config("llama3-70b")
    assert (c.hidden_size, c.num_layers, c.num_attention_heads, c.num_query_groups, c.kv_channels,
            c.ffn_hidden_size, c.vocab_size, c.rotary_base, c.tie_embeddings) == (
        8192, 80, 64, 8, 128, 28672, 128256, 500000.0, False)
    s = c.rope_scaling
    assert (s.rope_type, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) == (
        "llama3", 8.0, 1.0, 4.0, 8192)
