"""The estimate pool: estimates remembered on disk by configuration, machine and code; rounds traced on workers."""

from __future__ import annotations

import dataclasses

from megatron_lc.arguments import parse_config
from megatron_lc.planning.estimate import Machine, estimate
from megatron_lc.planning.estimate_pool import EstimateCache, EstimatePool

TINY = ["--model", "debug", "--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "256",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--vocab-size", "2048", "--device", "cpu",
        "--mock-data", "--seq-length", "2048"]
MACHINE = Machine(num_gpus=2, reserve_gib=0, device="cpu")


def _counting():
    calls = []

    def evaluate(cfg, machine, seq_length=None):
        calls.append(seq_length)
        return estimate(cfg, machine, seq_length)
    return evaluate, calls


def test_a_remembered_estimate_is_not_traced_again_across_estimators(tmp_path):
    cfg = parse_config(TINY)
    evaluate, calls = _counting()
    first = EstimatePool(evaluate, cache=EstimateCache(tmp_path)).many([(cfg, MACHINE, 2048), (cfg, MACHINE, 4096)])
    again = EstimatePool(evaluate, cache=EstimateCache(tmp_path))
    second = again.many([(cfg, MACHINE, 4096), (cfg, MACHINE, 2048)])
    assert calls == [2048, 4096] and again.cached == 2 and again.traced == 0
    assert [e.gpu_peak_bytes for e in second] == [first[1].gpu_peak_bytes, first[0].gpu_peak_bytes]
    other = parse_config([*TINY, "--recompute-granularity", "full"])  # another configuration: traced
    again(other, MACHINE, 2048)
    assert calls == [2048, 4096, 2048]


def test_an_unreadable_cache_file_is_traced_again(tmp_path):
    cfg = parse_config(TINY)
    evaluate, calls = _counting()
    EstimatePool(evaluate, cache=EstimateCache(tmp_path))(cfg, MACHINE, 2048)
    for path in tmp_path.iterdir():
        path.write_bytes(b"not a pickle")
    e = EstimatePool(evaluate, cache=EstimateCache(tmp_path))(cfg, MACHINE, 2048)
    assert calls == [2048, 2048] and e.fits


def _answer(e):
    return e.gpu_bytes_by_category, e.host_bytes_per_gpu, e.peak_phase, e.traced_layers, e.at_least


def test_workers_trace_what_this_process_traces():
    cfg, deep = parse_config(TINY), parse_config([*TINY, "--num-layers", "8"])  # deep: traced at 4 and 5 layers
    jobs = [(cfg, MACHINE, 2048), (cfg, MACHINE, 4096), (cfg, MACHINE, 6144)]
    with EstimatePool(workers=2) as pool:
        parallel = pool.many(jobs)
        # A round of one estimate on started workers: its two traces handed to them together.
        handed, run = [], pool._run_traces
        pool._run_traces = lambda trace_jobs: handed.append([job[2] for job in trace_jobs]) or run(trace_jobs)
        pool.stop_when_over = True  # traced at once, both traces count: never `at_least`
        small = dataclasses.replace(MACHINE, gpu_memory_gib=1e-3)
        alone, over = pool(deep, MACHINE, 2048), pool(deep, small, 2048)
    assert handed == [[4, 5], [4, 5]]
    serial = [estimate(*job) for job in jobs]
    assert [_answer(e) for e in parallel] == [_answer(e) for e in serial]
    assert _answer(alone) == _answer(estimate(deep, MACHINE, 2048)) and alone.traced_layers == (4, 5)
    assert _answer(over) == _answer(estimate(deep, small, 2048)) and not over.fits


def test_exact_estimates_are_remembered_apart_from_the_default_ones(tmp_path):
    cfg = parse_config(TINY)
    cache = EstimateCache(tmp_path)
    assert cache.key(cfg, MACHINE, 2048, exact=True) != cache.key(cfg, MACHINE, 2048)
    EstimatePool(cache=cache)(cfg, MACHINE, 2048)
    exact = EstimatePool(cache=EstimateCache(tmp_path), exact=True)
    exact(cfg, MACHINE, 2048)
    assert exact.traced == 1 and exact.cached == 0


def test_the_pool_says_which_estimates_it_remembers(tmp_path):
    cfg = parse_config(TINY)
    pool = EstimatePool(cache=EstimateCache(tmp_path))
    assert not pool.remembers((cfg, MACHINE, 2048))
    pool(cfg, MACHINE, 2048)
    assert pool.remembers((cfg, MACHINE, 2048))
    assert EstimatePool(cache=EstimateCache(tmp_path)).remembers((cfg, MACHINE, 2048))
    assert not EstimatePool(cache=EstimateCache(tmp_path), exact=True).remembers((cfg, MACHINE, 2048))


def test_a_packed_runs_estimate_is_keyed_by_its_data_files(tmp_path):
    """A packed run's step time is counted from its documents: the same flags over changed data files are another
    estimate; an unpacked run's key does not read the data."""
    prefix = tmp_path / "d_text_document"
    for suffix in (".bin", ".idx"):
        (tmp_path / f"d_text_document{suffix}").write_bytes(b"x")
    flags = [a for a in TINY if a != "--mock-data"] + ["--data-path", str(prefix)]
    cache = EstimateCache(tmp_path / "cache")
    packed, stream = (parse_config([*flags, "--packing", p]) for p in ("documents", "stream"))
    before = (cache.key(packed, MACHINE, 2048), cache.key(stream, MACHINE, 2048))
    (tmp_path / "d_text_document.bin").write_bytes(b"xy")  # the data changed
    assert cache.key(packed, MACHINE, 2048) != before[0]
    assert cache.key(stream, MACHINE, 2048) == before[1]
