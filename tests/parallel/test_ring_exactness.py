"""Ring and hierarchical (all-to-all x ring) context parallelism equal the single-process
fp32 reference: loss (1e-5) and every gradient (1e-4), over two optimizer steps, in
4-rank gloo runs (one launch runs them all); and a checkpoint resumes across layouts with the same losses."""

import dataclasses

import pytest

from megatron_lc.arguments import parse_config
from megatron_lc.models.llama import get_config
from megatron_lc.models.llama.parallelize import ParallelizeOptions
from megatron_lc.training.trainer import train
from tests.helpers import parallelize_options
from tests.exactness import BATCH, ONE_SEGMENT, check_against_reference, checks_that_ran
from tests.helpers import TRAIN_FLAGS as BASE, logged_losses, torchrun_train

DEBUG = get_config("debug")  # 8 heads, 2 kv heads
STACK_FIELDS = dict(recompute_granularity="full", offload_mode="prefetch", mlp_tiles=3, loss_tiles=5)
STACK = parallelize_options(**STACK_FIELDS)


GQA_ONE_KV_HEAD_A_RANK = dataclasses.replace(DEBUG, num_attention_heads=2, num_query_groups=1, kv_channels=32)
ARGS = {  # name -> check_against_reference's arguments after (rank, world): config, cp, options, batch, steps, ring
    "a2a+p2p-ulysses": (DEBUG, 4, parallelize_options(cp_impl="ulysses"), BATCH, 2, 2),
    "a2a+p2p-untied_ulysses": (DEBUG, 4, parallelize_options(cp_impl="untied_ulysses"), BATCH, 2, 2),
    "p2p-cp4-gqa": (GQA_ONE_KV_HEAD_A_RANK, 4, ParallelizeOptions(), ONE_SEGMENT, 2, 4),
    "a2a+p2p-one-kv-head": (dataclasses.replace(DEBUG, num_query_groups=1), 4, ParallelizeOptions(), ONE_SEGMENT, 2, 2),
    "dp2-ring2-stack": (DEBUG, 2, STACK, BATCH, 2, 2),
    "a2a+p2p-untied-stages-stack": (DEBUG, 4, parallelize_options(**STACK_FIELDS, cp_impl="untied_ulysses",
                                                                   heads_per_stage=4), ONE_SEGMENT, 2, 2),
    "a2a+p2p-lean-in-place-stack": (DEBUG, 4, parallelize_options(**STACK_FIELDS, cp_impl="untied_ulysses",
                                                                   heads_per_stage=2, untied_backward="lean",
                                                                   ring_kv_grads="in_place"), ONE_SEGMENT, 2, 2),
    "dp2-ring2-in-place-stack": (DEBUG, 2, parallelize_options(**STACK_FIELDS, ring_kv_grads="in_place"), BATCH, 2, 2),
}


@pytest.fixture(scope="module")
def checked():
    """Every 4-rank check of this file (`ARGS`) in one gloo launch: the names of those that ran."""
    return checks_that_ran({4: {name: (check_against_reference, args) for name, args in ARGS.items()}})


@pytest.mark.parametrize("cp_impl", ["ulysses", "untied_ulysses"])
def test_all_to_all_pairs_inside_a_ring_of_two_match_single_process(cp_impl, checked):
    """a2a+p2p 2 x 2: each all-to-all backend over rank pairs, ring attention across them."""
    assert f"a2a+p2p-{cp_impl}" in checked


def test_ring_over_four_ranks_with_gqa_and_fewer_heads_than_ranks_matches_single_process(checked):
    """p2p cp 4 with 2 query heads and 1 kv head: Ulysses would refuse it (heads < cp); each sample one
    attention segment (the ring with packed documents: the data-parallel case below)."""
    assert "p2p-cp4-gqa" in checked


def test_gqa_replicated_across_the_all_to_all_inside_a_ring_matches_single_process(checked):
    """a2a+p2p 2 x 2 with one kv head: replicated over the pair, travelling the ring at its own count;
    each sample one attention segment."""
    assert "a2a+p2p-one-kv-head" in checked


def test_ring_with_data_parallel_and_the_full_memory_stack_matches_single_process(checked):
    """dp 2 x ring 2, recompute + offload + tiled MLP and loss."""
    assert "dp2-ring2-stack" in checked


def test_untied_stages_in_a_ring_with_the_full_memory_stack_match_single_process(checked):
    """Each sample one attention segment (the untied pairs with packed documents: the all-to-all test above)."""
    assert "a2a+p2p-untied-stages-stack" in checked


def test_lean_backward_exchanges_with_the_full_memory_stack_match_single_process(checked):
    """a2a+p2p 2 x 2, Untied stages of one head per rank (2 stages per kv round) with the lean backward, the
    ring's accumulators rotated in place, full recompute + offload + tiled MLP and loss, FSDP."""
    assert "a2a+p2p-lean-in-place-stack" in checked


def test_ring_accumulators_rotated_in_place_with_data_parallel_match_single_process(checked):
    """dp 2 x ring 2 (packed documents), accumulators rotated in place, full memory stack."""
    assert "dp2-ring2-in-place-stack" in checked


@pytest.mark.parametrize("flags, message", [
    (["--cp-comm-type", "a2a+p2p"], "needs --hierarchical-context-parallel-sizes A R"),
    (["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "1"], "the product must be"),
    (["--hierarchical-context-parallel-sizes", "2", "2"], "is for --cp-comm-type a2a\\+p2p, not a2a"),
    (["--cp-comm-type", "p2p", "--seq-length", "68"], "--seq-length 68 is not divisible by 8 \\(4 ring ranks"),
    (["--cp-comm-type", "p2p", "--cp-impl", "untied_ulysses"], "does not have"),
    (["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "4", "1", "--num-attention-heads",
      "6", "--num-query-groups", "2"], "--num-attention-heads 6 is not divisible"),
    (["--num-attention-heads", "2", "--num-query-groups", "1"], "--cp-comm-type p2p"),
    (["--ring-kv-grads", "in_place"], "^--ring-kv-grads in_place sets ring attention's backward: it needs a ring"),
    (["--untied-backward", "lean"], "^--untied-backward lean sets what Untied Ulysses' backward holds: it needs"),
    (["--untied-backward", "lean", "--cp-impl", "untied_ulysses", "--cp-comm-type", "p2p"],
     "^--untied-backward lean sets what Untied Ulysses"),
    (["--cp-document-layout", "local"], "^--cp-document-layout local cuts a ring by documents: it needs a ring"),
])
def test_impossible_context_parallel_layouts_fail_before_any_work(flags, message):
    cfg = parse_config(BASE + ["--context-parallel-size", "4"] + flags)
    with pytest.raises(ValueError, match=message):
        cfg.validate(world_size=4)


def test_checkpoint_resumes_across_layouts_with_the_losses_of_one_process(tmp_path):
    """Step 1 with a2a cp 4, step 2 with a2a+p2p 2 x 2, step 3 in one process: the losses of one process."""
    reference = train(parse_config(BASE + ["--train-iters", "3", "--log-dir", str(tmp_path / "ref")]))
    cp4 = ["--context-parallel-size", "4", "--train-iters", "3", "--save", "ckpt", "--load", "ckpt"]
    torchrun_train(4, BASE + cp4 + ["--exit-interval", "1", "--log-dir", "a2a"], tmp_path)
    torchrun_train(4, BASE + cp4 + ["--exit-interval", "2", "--log-dir", "hier", "--cp-comm-type", "a2a+p2p",
                               "--hierarchical-context-parallel-sizes", "2", "2"], tmp_path)
    resumed = train(parse_config(BASE + ["--train-iters", "3", "--load", str(tmp_path / "ckpt"),
                                         "--log-dir", str(tmp_path / "one")]))
    losses = logged_losses(tmp_path / "a2a") + logged_losses(tmp_path / "hier") + [m["loss"] for m in resumed]
    assert losses == pytest.approx([m["loss"] for m in reference], rel=1e-5)
