"""--recompute-method / --recompute-num-layers with --recompute-granularity full, through the trainer."""

import pytest

from megatron_lc.errors import ConfigError
from megatron_lc.arguments import parse_config
from megatron_lc.training.trainer import build_run, train_one_step
from tests.helpers import train_flags

BASE = train_flags("--num-layers", "3", "--train-iters", "2", tiny_model=True)
FULL = ["--recompute-granularity", "full"]


def _losses(run) -> list[float]:
    return [train_one_step(run, step)["loss"] for step in (1, 2)]


def test_block_checkpoints_the_first_n_blocks_only_and_trains_the_same():
    plain = build_run(parse_config(BASE))
    block = build_run(parse_config(BASE + FULL + ["--recompute-method", "block", "--recompute-num-layers", "2"]))
    assert [layer.memory.recompute for layer in block.model.layers] == ["full", "full", "none"]
    assert _losses(block) == pytest.approx(_losses(plain), rel=1e-6)


def test_uniform_groups_of_one_and_full_alone_checkpoint_every_block():
    for extra in ([], ["--recompute-method", "uniform", "--recompute-num-layers", "1"]):
        run = build_run(parse_config(BASE + FULL + extra))
        assert [layer.memory.recompute for layer in run.model.layers] == ["full"] * 3


def test_block_with_offload_offloads_only_the_checkpointed_blocks():
    run = build_run(parse_config(BASE + FULL + ["--recompute-method", "block", "--recompute-num-layers", "2",
                                                "--offload-activations", "--offload-keep-last", "0"]))
    layers = run.model.layers
    assert layers[2].memory.offload is None and layers[0].memory.offload is run.offload
    assert run.offload.should_offload(0) and run.offload.should_offload(1)
    plain = build_run(parse_config(BASE))
    assert _losses(run) == pytest.approx(_losses(plain), rel=1e-6)


def test_block_with_sparse_offload_and_kept_attention_trains_the_same():
    """The first 3 of 4 blocks checkpointed and offloaded in segments of 2 (inputs of 0 and 2 kept), their
    attention outputs kept: the same losses as the plain model."""
    flags = ["--num-layers", "4", *FULL, "--recompute-method", "block", "--recompute-num-layers", "3",
             "--offload-activations", "--offload-keep-last", "0", "--offload-every-k-layers", "2",
             "--keep-attention-output"]
    run = build_run(parse_config(BASE + flags))
    assert [layer.memory.recompute for layer in run.model.layers] == ["full", "full", "full", "none"]
    plain = build_run(parse_config(BASE + ["--num-layers", "4"]))
    assert _losses(run) == pytest.approx(_losses(plain), rel=1e-6)


@pytest.mark.parametrize("flags, message", [
    (FULL + ["--recompute-method", "uniform", "--recompute-num-layers", "2"],
     "--recompute-method uniform --recompute-num-layers 2: checkpointing here is per block"),
    (["--recompute-method", "block", "--recompute-num-layers", "1"], "choose the blocks of --recompute-granularity full"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], "given: selective"),
    (FULL + ["--recompute-method", "block"], "--recompute-method and --recompute-num-layers go together"),
    (FULL + ["--recompute-method", "block", "--recompute-num-layers", "4"], "--recompute-num-layers 4 must be in 1..3"),
])
def test_recompute_method_flags_that_cannot_work_are_one_line_before_any_work(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(BASE + flags).validate(world_size=1)
