"""The kept attention outputs' host arenas are made and page-locked at start-up with the block inputs', in the
shapes each attention backend declares (`kept_tensors`): steps 1 and 2 page-lock nothing, and the bytes reserved are
the planner's. A recording stand-in takes the driver's page-locking; every backend runs packed documents."""

import contextlib
from unittest import mock

import pytest
import torch

from megatron_lc.arguments import config_from_values, parse_config
from megatron_lc.devices import Devices
from megatron_lc.memory import offload as offload_module
from megatron_lc.memory.kept_attention import ATTENTION_KIND
from megatron_lc.memory.offload import OffloadScheduler
from megatron_lc.parallel_state import ParallelState
from megatron_lc.planning.estimate import Machine, estimate
from megatron_lc.planning.timing import block_input_bytes_per_gpu, kept_attention_bytes_per_gpu
from megatron_lc.planning.trace import parallel_dims
from megatron_lc.testing import make_batch, rank_zero_result, shard_batch
from megatron_lc.training.build import build_run_optimizer, build_sharded_model, reserve_host_arenas
from megatron_lc.training.step import train_step
from tests.helpers import train_flags

CPU = Devices(torch.device("cpu"), torch.device("cpu"))


@contextlib.contextmanager
def recording_page_locks():
    """Offload arenas page-locked as on a GPU, the driver's registrations recorded as (address, bytes)."""
    locked = []
    init = OffloadScheduler.__init__

    def page_locked_init(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "page_locked": True})

    with mock.patch.object(offload_module, "page_lock", lambda t: locked.append((t.data_ptr(), t.nbytes))), \
            mock.patch.object(offload_module, "page_unlock", lambda t: None), \
            mock.patch.object(OffloadScheduler, "__init__", page_locked_init):
        yield locked


def _inside(buffer: torch.Tensor, locked) -> bool:
    start = buffer.data_ptr()
    return any(a <= start and start + buffer.nbytes <= a + n for a, n in locked)


def _check_reserved(offload: OffloadScheduler, locked: list) -> dict:
    """Every arena, kept attention's among them, locked once and whole; returns the arenas."""
    arenas = offload.arena_slots()
    assert any(kind == ATTENTION_KIND for _, _, kind in arenas), arenas
    assert len(locked) == len(arenas) and sum(n for _, n in locked) == offload.host_bytes_reserved
    assert all(_inside(view, locked) for view in offload.host_buffers())
    return arenas


# --- one process, through the trainer's start-up ------------------------------------------------------------------

KEEP = ["--num-layers", "4", "--recompute-granularity", "full", "--offload-mode", "prefetch", "--keep-attention-output",
        "--train-iters", "2"]


@pytest.mark.parametrize("more", [[], ["--keep-attention-output-layers", "2"], ["--bf16"]],
                         ids=["every-block", "first-2-of-4", "bf16"])
def test_start_up_locks_every_kept_attention_arena_and_steps_lock_nothing_more(more):
    from megatron_lc.training.trainer import build_run, train_one_step

    with recording_page_locks() as locked:
        run = build_run(parse_config(train_flags(*KEEP, *more)))
        arenas = _check_reserved(run.offload, locked)
        made = list(locked)
        for step in (1, 2):
            train_one_step(run, step)
            assert locked == made, f"step {step} page-locked {locked[len(made):]}"
            assert run.offload.arena_slots() == arenas and run.offload.host_bytes_in_use == 0
    planned = estimate(run.cfg, Machine(num_gpus=1, device="cpu", reserve_gib=0.0)).host_bytes_per_gpu
    assert run.offload.host_bytes_reserved == pytest.approx(planned, rel=0.01, abs=4096)


# --- every context-parallel backend, packed documents, FSDP over 4 ranks ----------------------------------------

BASE = dict(model="debug", num_layers=4, seq_length=64, mock_data=True, recompute_granularity="full",
            offload_mode="prefetch", keep_attention_output=True, context_parallel_size=4)
CASES = {
    "ulysses-cp2": dict(context_parallel_size=2),
    "ulysses-cp4-sparse-k2-replaying": dict(offload_every_k_layers=2, replay_kept_attention=True),
    "untied-cp4": dict(cp_impl="untied_ulysses"),
    "untied-cp4-lean-2-stages": dict(cp_impl="untied_ulysses", untied_backward="lean", untied_heads_per_stage=4),
    "ring-cp4-split-documents": dict(cp_comm_type="p2p"),
    "ring-cp4-sequence-chunks": dict(cp_comm_type="p2p", cp_document_layout="sequence"),
    "ulysses-2x2-ring": dict(cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2]),
    "untied-2x2-ring-lean": dict(cp_impl="untied_ulysses", cp_comm_type="a2a+p2p",
                                 hierarchical_context_parallel_sizes=[2, 2], untied_backward="lean"),
}
WORLD = 4


def _config(name):
    return config_from_values({**BASE, **CASES[name]})


def _local_batch(cfg, spec, pstate):
    """This rank's share of a micro-batch of 3 documents a sample, cut as the run's layout cuts it."""
    batch, per_sample = make_batch(pstate.dp_size, cfg.data.seq_length, spec.model.vocab_size, seed=1, num_docs=3)
    layout = spec.parallelize.cp.on(pstate.context_layout).layout
    return shard_batch(batch, per_sample, pstate.dp_rank, pstate.dp_size, pstate.cp_rank, pstate.cp_size, layout)


def _two_steps_after_start_up(rank, world, names):
    reserved = {}
    with recording_page_locks() as locked:
        for name in names:
            locked.clear()
            cfg = _config(name)
            spec = cfg.run_spec(world)
            pstate = ParallelState(parallel_dims(cfg, world))
            model, offload = build_sharded_model(cfg, spec, pstate, CPU)
            reserve_host_arenas(cfg, spec, model, offload, pstate.distributed)
            arenas, made = _check_reserved(offload, locked), list(locked)
            optimizer = build_run_optimizer(model, cfg, CPU)
            batch = _local_batch(cfg, spec, pstate)
            for step in (1, 2):
                train_step(model, optimizer, [batch], pstate, CPU.accelerator)
                assert locked == made, f"{name}: step {step} page-locked {locked[len(made):]}"
                assert offload.arena_slots() == arenas and offload.host_bytes_in_use == 0, name
            reserved[name] = offload.host_bytes_reserved
            offload.close()
    return reserved


@pytest.fixture(scope="module")
def reserved():
    return rank_zero_result(_two_steps_after_start_up, WORLD, sorted(CASES))


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_backend_declares_what_it_keeps_so_steps_lock_nothing_and_the_planner_counts_it(name, reserved):
    cfg = _config(name)
    spec = cfg.run_spec(WORLD)
    stack, layers = spec.parallelize.memory, spec.model.num_layers
    kept = min(stack.kept_attention_layers(layers), stack.offloaded_layers(layers))
    counted = stack.host_slots(layers) * block_input_bytes_per_gpu(cfg, spec) + kept * kept_attention_bytes_per_gpu(
        cfg, spec)
    assert reserved[name] == counted


@pytest.mark.parametrize("name", ["untied-2x2-ring-lean", "ulysses-cp4-sparse-k2-replaying"])
def test_the_planners_host_bytes_are_what_start_up_reserves(name, reserved):
    planned = estimate(_config(name), Machine(num_gpus=WORLD, device="cpu", reserve_gib=0.0)).host_bytes_per_gpu
    assert reserved[name] == pytest.approx(planned, rel=0.01, abs=4096)
