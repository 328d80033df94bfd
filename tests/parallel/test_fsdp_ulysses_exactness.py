"""FSDP2 + Ulysses context parallelism equal the single-process fp32 reference exactly (the gloo checks of one
world size in one launch)."""

import dataclasses

import pytest
import torch

from megatron_lc.models.llama import RopeScaling, build_model, get_config
from megatron_lc.models.llama.parallelize import ParallelizeOptions, materialize, parallelize_llama
from megatron_lc.parallel_state import ParallelDims, ParallelState
from tests.exactness import BATCH, CPU, ONE_SEGMENT, check_against_reference, checks_that_ran, full



DEBUG = get_config("debug")
ROPE_SCALINGS = {"dynamic": RopeScaling(rope_type="dynamic", factor=4.0),
                 "yarn": RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)}


def _rope_scaled(scaling):
    """64 tokens past 32 max positions (16 original ones)."""
    return dataclasses.replace(DEBUG, max_position_embeddings=32, rope_scaling=scaling)


def check_sharded_initialisation(rank, world, config):
    pstate = ParallelState(ParallelDims(world_size=world, cp=2))
    model = build_model(config, device="meta")
    parallelize_llama(model, pstate, ParallelizeOptions(), CPU)
    materialize(model, CPU, seed=5)
    reference = build_model(config, device="cpu", seed=5).state_dict()
    for n, p in model.named_parameters():
        assert torch.equal(full(p.detach()), reference[n]), n


CHECKS = {  # world size -> name -> (check, its arguments after (rank, world))
    2: {"dp1-cp2-per-document": (check_against_reference, (DEBUG, 2, ParallelizeOptions(), BATCH)),
        "tied-embeddings": (check_against_reference, (get_config("debug-tied"), 2, ParallelizeOptions(), BATCH)),
        **{f"rope-{name}": (check_against_reference, (_rope_scaled(scaling), 2, ParallelizeOptions(), BATCH))
           for name, scaling in ROPE_SCALINGS.items()},
        "fsdp-without-cp": (check_against_reference, (DEBUG, 1, ParallelizeOptions(), BATCH))},
    4: {"dp1-cp4-one-segment": (check_against_reference, (DEBUG, 4, ParallelizeOptions(), ONE_SEGMENT)),
        "dp2-cp2-per-document": (check_against_reference, (DEBUG, 2, ParallelizeOptions(), BATCH)),
        "gqa-one-kv-head": (check_against_reference,  # 1 kv head, cp = 4
                            (dataclasses.replace(DEBUG, num_query_groups=1), 4, ParallelizeOptions(), BATCH)),
        "sharded-initialisation": (check_sharded_initialisation, (DEBUG,))},
}


@pytest.fixture(scope="module")
def checked():
    """Every check of this file in one gloo launch per world size (`CHECKS`): the names of those that ran."""
    return checks_that_ran(CHECKS)


@pytest.mark.parametrize("name", ["dp1-cp2-per-document", "dp1-cp4-one-segment", "dp2-cp2-per-document"])
def test_fsdp_ulysses_matches_single_process(name, checked):
    assert name in checked


def test_gqa_with_more_cp_ranks_than_kv_heads_matches_single_process(checked):
    assert "gqa-one-kv-head" in checked


def test_tied_embeddings_under_fsdp_and_cp_match_single_process(checked):
    assert "tied-embeddings" in checked


@pytest.mark.parametrize("scaling", sorted(ROPE_SCALINGS))
def test_rope_scalings_of_context_extension_under_cp_match_single_process(scaling, checked):
    """Dynamic NTK scales by the sample length on every cp rank, whichever slice it holds; yarn's factor on
    cos and sin reaches every rank (64 tokens past 32 max positions / 16 original ones)."""
    assert f"rope-{scaling}" in checked


def test_fsdp_without_cp_matches_single_process(checked):
    assert "fsdp-without-cp" in checked


def test_sharded_initialisation_equals_single_process_weights(checked):
    assert "sharded-initialisation" in checked
