"""The warm-up before step 1: every collective kind the step uses, once on every group that uses it."""

import pytest
import torch
import torch.distributed as dist

from megatron_lc.parallel_state import ParallelDims, ParallelState, collective_plan, warm_up_collectives
from tests.exactness import checks_that_ran

BASE_PLAN = [("all_reduce", "world"), ("all_reduce", "loss"),
             ("all_gather", "fsdp"), ("reduce_scatter", "fsdp"), ("all_reduce", "fsdp")]


@pytest.mark.parametrize("dims, extra", [
    (ParallelDims(1), None),
    (ParallelDims(2), []),  # FSDP alone
    (ParallelDims(4, cp=4), [("all_to_all", "a2a")]),  # Ulysses
    (ParallelDims(4, cp=4, cp_ring=4), [("send_recv", "ring")]),  # the ring alone (p2p)
    (ParallelDims(4, cp=4, cp_ring=2), [("all_to_all", "a2a"), ("send_recv", "ring")]),  # a2a+p2p 2 x 2
    (ParallelDims(4, cp=2, dp_replicate=2), [("all_reduce", "fsdp_replicate"), ("all_to_all", "a2a")]),  # HSDP
], ids=["one-rank", "fsdp", "ulysses", "ring", "a2a+p2p", "hsdp"])
def test_plan_names_each_collective_the_step_runs(dims, extra):
    assert collective_plan(dims) == ([] if extra is None else BASE_PLAN + extra)


def _ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def _record(seen: list):
    """Wrap torch.distributed's collectives so each call is recorded as (kind, ranks of its group)."""
    originals = {}

    def wrap(name, kind):
        original = originals[name] = getattr(dist, name)

        def recorded(*args, group=None, **kwargs):
            seen.append((kind, _ranks(group)))
            return original(*args, group=group, **kwargs)

        setattr(dist, name, recorded)

    for name, kind in (("all_reduce", "all_reduce"), ("all_gather_into_tensor", "all_gather"),
                       ("reduce_scatter_tensor", "reduce_scatter"), ("all_to_all_single", "all_to_all")):
        wrap(name, kind)
    original_batch = originals["batch_isend_irecv"] = dist.batch_isend_irecv

    def batch(ops):
        peers = sorted(op.peer for op in ops)
        seen.append(("send_recv", _ranks(ops[0].group), tuple(peers)))
        return original_batch(ops)

    dist.batch_isend_irecv = batch
    return originals


def check_warm_up(rank, world, dims_kwargs, expected_groups):
    """The recording wrapper sees every planned collective once, each on the group `expected_groups` names."""
    pstate = ParallelState(ParallelDims(world, **dims_kwargs))
    seen = []
    originals = _record(seen)
    try:
        warm_up_collectives(pstate, torch.device("cpu"))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    want = []
    for kind, name in collective_plan(pstate.dims):
        ranks = expected_groups[name][rank]
        if kind == "send_recv":  # to the next and from the previous rank of the ring
            i = ranks.index(rank)
            want.append((kind, ranks, tuple(sorted((ranks[(i + 1) % len(ranks)], ranks[(i - 1) % len(ranks)])))))
        else:
            want.append((kind, ranks))
    assert seen == want, (rank, seen, want)


def _every_rank(*groups):
    """{rank: its group} for a partition of the ranks."""
    return {r: g for g in groups for r in g}


ALL2, ALL4 = _every_rank((0, 1)), _every_rank((0, 1, 2, 3))


PAIRS = _every_rank((0, 1), (2, 3))
CASES = {  # name: (world, parallel degrees, each group's ranks)
    "two-ranks-fsdp-and-ulysses": (2, dict(cp=2), {"world": ALL2, "loss": ALL2, "fsdp": ALL2, "a2a": ALL2}),
    "two-ranks-ring": (2, dict(cp=2, cp_ring=2), {"world": ALL2, "loss": ALL2, "fsdp": ALL2, "ring": ALL2}),
    "four-ranks-a2a-pairs-in-a-ring": (4, dict(cp=4, cp_ring=2), {"world": ALL4, "loss": ALL4, "fsdp": ALL4,
                                                                   "a2a": PAIRS, "ring": _every_rank((0, 2), (1, 3))}),
    "four-ranks-hsdp-ulysses-pairs": (4, dict(cp=2, dp_replicate=2), {
        "world": ALL4, "loss": ALL4, "fsdp": PAIRS, "fsdp_replicate": _every_rank((0, 2), (1, 3)), "a2a": PAIRS}),
}


@pytest.fixture(scope="module")
def checked():
    """Every case (`CASES`), one gloo launch per world size: the names of those that ran."""
    checks = {}
    for name, (world, dims, groups) in CASES.items():
        checks.setdefault(world, {})[name] = (check_warm_up, (dims, groups))
    return checks_that_ran(checks)


def test_two_ranks_fsdp_and_ulysses(checked):
    assert "two-ranks-fsdp-and-ulysses" in checked


def test_two_ranks_ring(checked):
    assert "two-ranks-ring" in checked


def test_four_ranks_all_to_all_pairs_inside_a_ring_of_two(checked):
    """--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2: a2a over (0,1) and (2,3), rings (0,2), (1,3)."""
    assert "four-ranks-a2a-pairs-in-a-ring" in checked


def test_four_ranks_hsdp_with_ulysses_pairs(checked):
    """dp_replicate 2 x cp 2: FSDP shards over each cp pair, replicas all-reduce across them."""
    assert "four-ranks-hsdp-ulysses-pairs" in checked


def test_the_trainer_warms_up_right_after_the_mesh(monkeypatch):
    from megatron_lc.arguments import parse_config
    from megatron_lc.training import startup, trainer

    order = []
    monkeypatch.setattr(startup, "warm_up_collectives", lambda pstate, device: order.append(("warm_up", device)))
    real_build = trainer.build_sharded_model
    monkeypatch.setattr(trainer, "build_sharded_model",
                        lambda *a, **k: (order.append(("model", None)), real_build(*a, **k))[1])
    trainer.build_run(parse_config(["--mock-data", "--seq-length", "64", "--device", "cpu"]))
    assert order == [("warm_up", torch.device("cpu")), ("model", None)]
