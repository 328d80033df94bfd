"""The slow tiers are read from what a test calls: directly, through a helper, or not at all."""

import subprocess

from megatron_lc.planning.estimate import estimate
from megatron_lc.testing import rank_zero_result, run_distributed
from tests.tiers import planner_tracers, process_starters, uses


def _runs_a_tool():
    return subprocess.run(["true"], check=True)


def _through_a_helper():
    return _runs_a_tool()


def _gloo_world():
    run_distributed(print, 2)


def _gloo_world_answering():
    return rank_zero_result(print, 2)


def _plans(cfg, machine):
    return [estimate(cfg, machine) for _ in range(2)]  # inside a comprehension


def _in_process(x):
    return sorted(x)


def test_a_test_starting_processes_directly_or_through_a_helper_is_multiprocess():
    assert uses(_runs_a_tool, process_starters()) and uses(_through_a_helper, process_starters())
    assert uses(_gloo_world, process_starters()) and uses(_gloo_world_answering, process_starters())


def test_a_test_tracing_with_the_planner_is_planner_trace_and_only_that():
    assert uses(_plans, planner_tracers()) and not uses(_plans, process_starters())


def test_a_test_that_does_neither_is_in_the_fast_tier():
    assert not uses(_in_process, process_starters()) and not uses(_in_process, planner_tracers())
