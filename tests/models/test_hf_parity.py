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
