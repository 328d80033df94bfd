"""The test tiers: which tests start other processes or trace with the memory planner, read from what they call.

`tests/conftest.py` marks each collected test from these; `make test-fast` leaves the marked ones out.
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing
import subprocess
import types

import torch.multiprocessing

MARKERS = {
    "multiprocess": "starts other processes (gloo worlds, torchrun, a tool's command line); not in `make test-fast`",
    "planner_trace": "traces a training step with the memory planner; not in `make test-fast`",
}


@functools.cache
def process_starters() -> frozenset:
    """What starts another process: the modules that do, and the gloo worlds' launchers."""
    from megatron_lc import testing

    return frozenset({subprocess, multiprocessing, torch.multiprocessing, testing.run_distributed,
                      testing.rank_zero_result})


@functools.cache
def planner_tracers() -> frozenset:
    """The planner's entry points that trace a step: one estimate, the searches over estimates, its command line."""
    from megatron_lc.planning import cli
    from megatron_lc.planning.autofit import auto_fit
    from megatron_lc.planning.estimate import estimate
    from megatron_lc.planning.estimate_pool import EstimatePool
    from megatron_lc.planning.search import ablate, find_max_seq_length
    from megatron_lc.planning.trace import measure_real_step, trace_step

    return frozenset({cli, estimate, find_max_seq_length, ablate, auto_fit, EstimatePool, trace_step, measure_real_step})


TIERS = {"multiprocess": process_starters, "planner_trace": planner_tracers}
"""Each slow tier's marker and what a test uses to belong to it."""


def _code_objects(code: types.CodeType):
    """A function's code and the code of the lambdas, comprehensions and inner functions it defines."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _is_test_code(obj) -> bool:
    """Defined under tests/ (a helper or fixture whose own calls count as the test's)."""
    module = getattr(obj, "__module__", None) or ""
    return module.split(".")[0] in ("tests", "conftest") or module.startswith("test_")


def _is_target(obj, targets: frozenset) -> bool:
    try:
        return obj in targets
    except Exception:  # unhashable, or an `==` that is not a bool (a tensor)
        return False


def uses(fn, targets: frozenset, seen: set | None = None) -> bool:
    """Whether `fn`, or a test-suite function it names, names one of `targets`, or a module attribute that is one
    (`subprocess.run`, `estimate_memory.main`)."""
    seen = set() if seen is None else seen
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    scope = getattr(fn, "__globals__", {})
    for c in _code_objects(code):
        for name in c.co_names:
            obj = scope.get(name)
            if obj is None:
                continue
            if _is_target(obj, targets):
                return True
            if isinstance(obj, types.ModuleType):
                if any(_is_target(vars(obj).get(attr), targets) for attr in c.co_names):
                    return True
            elif inspect.isfunction(obj) and _is_test_code(obj) and uses(obj, targets, seen):
                return True
    return False


def _functions_of(item) -> list:
    """The test function and the fixtures it requests (transitively, as pytest resolved them)."""
    fns = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        fns.extend(d.func for d in defs if _is_test_code(d.func))
    return [fn for fn in fns if fn is not None]


def tier_markers(item) -> list[str]:
    """The markers of a collected test: the tiers whose targets it, its fixtures or its helpers use."""
    fns = _functions_of(item)
    return [name for name, targets in TIERS.items() if any(uses(fn, targets()) for fn in fns)]
