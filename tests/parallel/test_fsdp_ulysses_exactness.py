"""FSDP2 + Ulysses context parallelism equal the single-process fp32 reference exactly."""

import dataclasses

import pytest
import torch

from megatron_lc.models.llama import RopeScaling, build_model, get_config
from megatron_lc.models.llama.parallelize import ParallelizeOptions, materialize, parallelize_llama
from megatron_lc.parallel_state import ParallelDims, ParallelState
from tests.exactness import BATCH, CPU, ONE_SEGMENT, check_against_reference, full
from tests.helpers import run_distributed



@pytest.mark.parametrize("world, cp, batch", [(2, 2, BATCH), (4, 4, ONE_SEGMENT), (4, 2, BATCH)],
                         ids=["dp1-cp2-per-document", "dp1-cp4-one-segment", "dp2-cp2-per-document"])
def test_fsdp_ulysses_matches_single_process(world, cp, batch):
    run_distributed(check_against_reference, world, get_config("debug"), cp, ParallelizeOptions(), batch)


def test_gqa_with_more_cp_ranks_than_kv_heads_matches_single_process():
    config = dataclasses.replace(get_config("debug"), num_query_groups=1)  # 1 kv head, cp = 4
    run_distributed(check_against_reference, 4, config, 4, ParallelizeOptions(), BATCH)


def test_tied_embeddings_under_fsdp_and_cp_match_single_process():
    run_distributed(check_against_reference, 2, get_config("debug-tied"), 2, ParallelizeOptions(), BATCH)


@pytest.mark.parametrize("scaling", [RopeScaling(rope_type="dynamic", factor=4.0),
                                     RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)],
                         ids=["dynamic", "yarn"])
def test_rope_scalings_of_context_extension_under_cp_match_single_process(scaling):
    """Dynamic NTK scales by the sample length on every cp rank, whichever slice it holds; yarn's factor on
    cos and sin reaches every rank (64 tokens past 32 max positions / 16 original ones)."""
    config = dataclasses.replace(get_config("debug"), max_position_embeddings=32, rope_scaling=scaling)
    run_distributed(check_against_reference, 2, config, 2, ParallelizeOptions(), BATCH)


def test_fsdp_without_cp_matches_single_process():
    run_distributed(check_against_reference, 2, get_config("debug"), 1, ParallelizeOptions(), BATCH)


def check_sharded_initialisation(rank, world, config):
    pstate = ParallelState(ParallelDims(world_size=world, cp=2))
    model = build_model(config, device="meta")
    parallelize_llama(model, pstate, ParallelizeOptions(), CPU)
    materialize(model, CPU, seed=5)
    reference = build_model(config, device="cpu", seed=5).state_dict()
    for n, p in model.named_parameters():
        assert torch.equal(full(p.detach()), reference[n]), n


def test_sharded_initialisation_equals_single_process_weights():
    run_distributed(check_sharded_initialisation, 4, get_config("debug"))
