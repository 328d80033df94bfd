"""The chunk scheduler: deterministic plans from config, explicit counts win, clear errors."""

import dataclasses

import pytest

from megatron_lc.memory import ChunkPlan, plan_chunks
from megatron_lc.memory.chunks import DEFAULT_LOSS_BUDGET_BYTES

LLAMA3_8B = dict(hidden_size=4096, ffn_hidden_size=14336, vocab_size=128256, dtype_bytes=2)


def test_automatic_plan_for_llama3_8b_at_625k_local_tokens():
    plan = plan_chunks(625_000, **LLAMA3_8B)
    # MLP: tiles of about hidden_size tokens (ceil(625000 / 4096)).
    assert plan.mlp_tiles == 153
    # Loss: 1 GiB of fp32 logits holds 2093 rows of 128256; ceil(625000 / 2093).
    assert plan.loss_tiles == 299
    assert -(-625_000 // plan.loss_tiles) * 128256 * 4 <= DEFAULT_LOSS_BUDGET_BYTES
    assert plan.heads_per_stage is None


def test_plan_is_deterministic_and_frozen():
    plans = {
        plan_chunks(100_003, **LLAMA3_8B, num_attention_heads=32, context_parallel_size=8)
        for _ in range(3)
    }
    assert len(plans) == 1
    plan = plans.pop()
    assert plan.heads_per_stage == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.mlp_tiles = 2


def test_explicit_counts_win_and_budget_applies_to_both():
    plan = plan_chunks(10_000, **LLAMA3_8B, mlp_tiles=3, loss_tiles=5, heads_per_stage=16)
    assert plan == ChunkPlan(mlp_tiles=3, loss_tiles=5, heads_per_stage=16)
    small = plan_chunks(1000, 64, 256, 1000, 4, budget_bytes=100 * 1000 * 4)
    assert small == ChunkPlan(
        mlp_tiles=3, loss_tiles=10, heads_per_stage=None
    )  # 390 and 100 rows a tile


def test_short_sequences_need_one_tile():
    assert plan_chunks(512, **LLAMA3_8B) == ChunkPlan(1, 1, None)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(local_tokens=0), ValueError, "local_tokens must be >= 1, got 0"),
        (dict(hidden_size=4096.0), TypeError, "hidden_size must be an int"),
        (dict(vocab_size=True), TypeError, "vocab_size must be an int"),
        (dict(dtype_bytes=3), ValueError, "dtype_bytes must be one of"),
        (dict(mlp_tiles=0), ValueError, "mlp_tiles must be >= 1, got 0"),
        (dict(loss_tiles=20_000), ValueError, "loss_tiles=20000 exceeds local_tokens=10000"),
        (
            dict(budget_bytes=1000),
            ValueError,
            "one row needs 28672 bytes, more than budget_bytes=1000",
        ),
        (
            dict(heads_per_stage=12, context_parallel_size=8),
            ValueError,
            "multiple of context_parallel_size=8",
        ),
        (
            dict(heads_per_stage=24, num_attention_heads=32),
            ValueError,
            "must divide num_attention_heads=32",
        ),
    ],
)
def test_invalid_inputs_raise_clear_errors(kwargs, error, message):
    args = dict(local_tokens=10_000, **LLAMA3_8B)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        plan_chunks(**args)
