"""Auto-fit: the fastest memory stack that fits, against real traces of a tiny model and a synthetic planner."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest

from megatron_lc.planning import cli as estimate_memory
from megatron_lc.arguments import parse_config
from megatron_lc.planning.autofit import TOLERANCE, auto_fit
from megatron_lc.planning.search_space import (
    MODES,
    AttentionLevel,
    Candidate,
    SearchSpace,
    search_space,
    strip_memory_flags,
)
from megatron_lc.planning.estimate import GIB, Estimate, Machine, estimate
from megatron_lc.planning.timing import TimeModel


# Activations, not parameters, set this model's peak, so every memory technique moves it.
TINY = ["--model", "debug", "--seq-length", "16384", "--context-parallel-size", "2", "--hidden-size", "256",
        "--ffn-hidden-size", "1024", "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "64",
        "--vocab-size", "4096", "--num-layers", "2", "--device", "cpu"]


def _machine(gpu_bytes: float, host_gib: float = 1907.0, num_gpus: int = 2) -> Machine:
    return Machine(num_gpus=num_gpus, gpu_memory_gib=gpu_bytes / GIB, reserve_gib=0, host_memory_gib=host_gib,
                   host_reserve_gib=0, device="cpu")


def _key(cfg) -> str:
    return repr((cfg.memory, cfg.parallel))


@pytest.fixture(scope="module")
def tiny():
    """The tiny config, a small search space (Ulysses only) and every candidate of it traced once."""
    cfg = parse_config([*TINY, "--mock-data"])
    full = search_space(cfg, 2)
    space = SearchSpace(full.modes, (None, full.mlp_tiles[-1]), (None, 1), full.attention[:1])
    machine = _machine(100 * GIB)
    traced = {}
    for point in space.points():
        candidate = space.candidate(point)
        traced[_key(candidate.apply(cfg))] = (candidate, estimate(candidate.apply(cfg), machine))
    return cfg, space, traced


def _cached(traced):
    """An evaluator answering from the traces (peaks do not depend on the budget), counting its calls."""
    calls = []

    def evaluate(cfg, machine, seq_length):
        calls.append(_key(cfg))
        return dataclasses.replace(traced[_key(cfg)][1], machine=machine)
    return evaluate, calls


def _step_s(c: Candidate, cfg, machine: Machine) -> float:
    """The candidate's predicted step, as auto-fit predicts it."""
    return TimeModel.for_machine(machine, cfg).predict(c.apply(cfg), machine.num_gpus).step_s


def _cheapest_fitting(cfg, traced, machine) -> Candidate | None:
    fitting = [c for c, e in traced.values() if dataclasses.replace(e, machine=machine).fits]
    return min(fitting, key=lambda c: _step_s(c, cfg, machine), default=None)


def test_generous_budget_needs_no_memory_technique(tiny):
    cfg, space, traced = tiny
    peak = max(e.gpu_peak_bytes for _, e in traced.values())
    evaluate, _ = _cached(traced)
    result = auto_fit(cfg, _machine(peak * 1.01), evaluate=evaluate, space=space)
    assert result.choice.flags() == []
    assert result.choice.recompute == "none" and result.choice.offload == "none"


def test_tight_budget_needs_the_whole_stack(tiny):
    cfg, space, traced = tiny
    peak = min(e.gpu_peak_bytes for _, e in traced.values())
    evaluate, _ = _cached(traced)
    c = auto_fit(cfg, _machine(peak), evaluate=evaluate, space=space).choice
    # Fetching on demand saves nothing more here, and the tiny model's peak is not in a block's backward, so the
    # early prefetch (predicted faster) costs nothing either.
    assert (c.recompute, c.offload) == ("full", "early")
    assert c.mlp_tiles and c.loss_tiles
    assert auto_fit(cfg, _machine(peak - 1), evaluate=evaluate, space=space).choice is None


def test_choice_is_the_cheapest_fitting_candidate_at_every_budget(tiny):
    cfg, space, traced = tiny
    peaks = sorted({e.gpu_peak_bytes for _, e in traced.values()})
    for budget in peaks:
        machine = _machine(budget)
        evaluate, calls = _cached(traced)
        result = auto_fit(cfg, machine, evaluate=evaluate, space=space, tolerance=0)
        assert result.choice == _cheapest_fitting(cfg, traced, machine), budget
        assert result.estimate.fits and not result.capped
        assert len(calls) == len(set(calls)) < len(space.points())


def _synthetic(space: SearchSpace, cfg):
    """A planner whose memory falls with every choice within a family; Untied holds more than Ulysses
    without recompute and less with it (as on small and large models); the lean exchanges hold less; offload costs host bytes, 1/k of them
    with sparse offload; kept attention outputs add as many host bytes when offloading, else GPU bytes."""
    points = {space.candidate(p): p for p in space.points()}

    def evaluate(c, machine, seq_length):
        mode, mlp, loss, attn, _, _ = points[Candidate(
            c.memory.recompute_granularity,
            c.memory.offload_mode,
            c.memory.tiled_mlp_tiles, c.memory.tiled_loss_tiles,
            c.parallel.cp_impl, c.parallel.untied_heads_per_stage, c.memory.offload_every_k_layers,
            c.memory.keep_attention_output, untied_backward=c.parallel.untied_backward,
            ring_kv_grads=c.parallel.ring_kv_grads)]  # a pipelined candidate: its synchronous twin's point
        level = space.attention[attn]
        untied, offloads, keep = level.impl == "untied_ulysses", space.modes[mode][1] != "none", \
            c.memory.keep_attention_output
        width = sum(a.impl == "untied_ulysses" and not a.lean for a in space.attention[:attn + 1])  # 1: widest
        layer = 100 - 18 * mode - 9 * mlp - (6 * width + 5 if untied and mode >= 2 else -4 * untied)
        layer -= 4 if level.lean else 0  # no fp32 round sums
        layer += (1 if offloads else 12) if keep else 0
        layer += 3 if c.parallel.untied_overlap_stages else 0  # pipelined: a second set of stage buffers
        head = 80 - 7 * loss
        gpu = max(layer, head) * 10 ** 6
        host = 500 * 10 ** 6 // c.memory.offload_every_k_layers + (500 * 10 ** 6 if keep else 0) if offloads else 0
        by_category = dict.fromkeys(("parameters", "gradients", "optimizer state", "activations",
                                     "communication buffers", "temporaries"), 0)
        by_category["activations"] = gpu
        return Estimate(seq_length, by_category, 0, host // machine.gpus_on_node, "test", [], 0, (1,), machine)
    return evaluate


class _Memo:
    """A time model answering each configuration once (the searches of one test share the machine's rates)."""

    def __init__(self, model: TimeModel):
        self.model, self.rates, self.family, self._seen = model, model.rates, model.family, {}

    def predict(self, cfg, num_gpus):
        key = (_key(cfg), num_gpus)
        if key not in self._seen:
            self._seen[key] = self.model.predict(cfg, num_gpus)
        return self._seen[key]


@pytest.mark.parametrize("tolerance", [0.0, TOLERANCE])
@pytest.mark.parametrize("host_gib", [1907.0, 0.4, 0.1])
def test_search_matches_brute_force_on_a_synthetic_planner(host_gib, tolerance):
    """The answer is the fastest stack that fits, or within the tolerance of it."""
    cfg = parse_config(["--model", "llama3-8b", "--bf16", "--seq-length", "262144", "--context-parallel-size", "8",
                        "--mock-data"])
    space = search_space(cfg, 8)
    assert [a.impl for a in space.attention] == ["ulysses", *["untied_ulysses"] * 8]
    assert [a.overlap for a in space.attention] == [False, False, False, True, True, False, False, True, True]
    assert [a.untied_backward for a in space.attention] == ["fast"] * 5 + ["lean"] * 4  # no ring: no lean Ulysses
    # Pipelined stages are tried on the answer, not searched: their test is the one below.
    space = dataclasses.replace(space, attention=tuple(a for a in space.attention if not a.overlap))
    evaluate = _synthetic(space, cfg)
    everything = {c: evaluate(c.apply(cfg), _machine(GIB, num_gpus=8), 0) for c in map(space.candidate, space.points())}
    step_s = {c: _step_s(c, cfg, _machine(GIB, host_gib, 8)) for c in everything}  # rates do not depend on the budget
    time_model = _Memo(TimeModel.for_machine(_machine(GIB, host_gib, 8), cfg))
    for budget in sorted({e.gpu_peak_bytes for e in everything.values()}):
        machine = _machine(budget, host_gib, 8)
        calls = []
        result = auto_fit(cfg, machine, time_model, evaluate=lambda *a: calls.append(a) or evaluate(*a), space=space,
                          tolerance=tolerance, max_traces=100)
        fitting = [c for c, e in everything.items() if dataclasses.replace(e, machine=machine).fits]
        best = min(fitting, key=lambda c: (step_s[c], c.flags()), default=None)
        assert (result.choice is None) == (best is None), budget
        if best is not None:
            chosen = _step_s(result.choice, cfg, machine)
            assert result.estimate.fits and step_s[best] <= chosen <= step_s[best] * (1 + tolerance), budget
        # Telling apart steps within 1% costs traces: at most 40 with the tolerance, more for the exact answer.
        assert len(calls) <= (40 if tolerance else 100) and not result.capped, len(calls)
        if host_gib < 0.2 and result.choice:
            assert result.choice.offload == "none"
        elif host_gib < 1 and result.choice and result.choice.offload != "none":
            assert result.choice.offload_every >= 2  # 500 MB of block inputs do not fit 0.4 GiB, 250 MB do


def test_trace_cap_answers_with_a_candidate_known_to_fit(tiny):
    cfg, space, traced = tiny
    peaks = sorted({e.gpu_peak_bytes for _, e in traced.values()})
    evaluate, calls = _cached(traced)
    result = auto_fit(cfg, _machine(peaks[len(peaks) // 2]), evaluate=evaluate, space=space, max_traces=2)
    assert result.capped and result.estimate.fits and len(calls) <= 3


def test_strip_memory_flags():
    argv = ["--model", "x", "--recompute-granularity", "full", "--tiled-mlp", "--cp-impl=untied_ulysses",
            "--untied-heads-per-stage", "8", "--bf16", "--offload-activations", "--tiled-loss-tiles", "3"]
    assert strip_memory_flags(argv) == ["--model", "x", "--bf16"]


def test_command_line_flags_parse_and_validate():
    base = [*TINY, "--num-gpus", "2", "--reserve-gib", "0", "--gpu-memory-gib", "0.25", "--recompute-granularity",
            "selective", "--auto-fit", "--auto-fit-max-traces", "10", "--json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert estimate_memory.main(base) == 0
    got = json.loads(out.getvalue())
    fit = got["auto_fit"]
    assert {"flags", "gpu_peak_gib", "host_peak_gib", "time", "command", "traced"} <= fit.keys()
    assert got["fits"] and got["gpu_peak_gib"] == fit["gpu_peak_gib"] <= 0.25
    assert fit["flags"] and fit["time"]["step_s"] > 0 and len(fit["traced"]) < fit["candidates"]
    assert got["time"]["step_s"] == fit["time"]["step_s"]  # the answer's estimate carries its predicted time
    command = fit["command"]
    assert command[:5] == ["torchrun", "--nproc-per-node", "2", "-m", "megatron_lc.train"]
    assert command[-len(fit["flags"]):] == fit["flags"]
    cfg = parse_config(_with_mock_data(command[5:]))
    cfg.validate(2)
    assert (cfg.memory.recompute_granularity, cfg.memory.offload_mode) in set(MODES)
    assert cfg.memory.tiled_loss and cfg.memory.tiled_loss_tiles == 1  # the untiled loss cannot fit 0.25 GiB


def _with_mock_data(train_args: list[str]) -> list[str]:
    """The printed training flags with the data placeholder (given no data flags, the planner names one) replaced
    by --mock-data."""
    i = train_args.index("--data-path")
    assert train_args[i + 1] == estimate_memory.DATA_PLACEHOLDER
    return [*train_args[:i], *train_args[i + 2:], "--mock-data"]


def test_printed_command_launches_every_node_and_keeps_the_data_flags():
    """One torchrun per node with --nnodes beyond one node, and the data flags given to the planner as given."""
    one = Machine(num_gpus=4)
    assert estimate_memory.launch_command(one, ["--mock-data"]) == [
        "torchrun", "--nproc-per-node", "4", "-m", "megatron_lc.train", "--mock-data"]
    two = estimate_memory.launch_command(Machine(num_gpus=16), ["--data-path", "d/c_text_document"])
    assert two[:5] == ["torchrun", "--nproc-per-node", "8", "--nnodes", "2"]
    assert two[-3:] == ["megatron_lc.train", "--data-path", "d/c_text_document"]
    assert estimate_memory.DATA_PLACEHOLDER not in two


@pytest.mark.parametrize("mode", ["--auto-fit", "--find-max-seq-length"])
def test_nothing_fits_exits_1_with_the_reason(mode):
    argv = [*TINY, "--num-gpus", "2", "--reserve-gib", "0", "--gpu-memory-gib", "0.001", "--recompute-granularity",
            "full", mode, "--json"]
    if mode == "--auto-fit":
        argv += ["--auto-fit-max-traces", "3"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert estimate_memory.main(argv) == 1
    got = json.loads(out.getvalue())
    reason = got["auto_fit"]["reason"] if mode == "--auto-fit" else got["reason"]
    assert reason.startswith("nothing fits: ") and "GiB of 0.00" in reason and not got["fits"]


def test_untied_stage_widths_follow_the_all_to_all_level_of_a_hierarchical_layout():
    """a2a+p2p 4 x 2 (cp 8): stages are multiples of the all-to-all degree 4, not of cp; a ring alone has no
    all-to-all level to choose."""
    base = ["--model", "debug", "--mock-data", "--seq-length", "1024", "--context-parallel-size", "8"]
    hierarchical = parse_config(base + ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "4",
                                        "2"])
    lean = {"untied_backward": "lean", "ring_kv_grads": "in_place"}
    assert search_space(hierarchical, 8).attention == (
        AttentionLevel("ulysses"), AttentionLevel("untied_ulysses", 4), AttentionLevel("untied_ulysses", 4, True),
        AttentionLevel("ulysses", ring_kv_grads="in_place"), AttentionLevel("untied_ulysses", 4, **lean),
        AttentionLevel("untied_ulysses", 4, True, **lean))
    assert search_space(parse_config(base + ["--cp-comm-type", "p2p"]), 8).attention == (
        AttentionLevel(None), AttentionLevel(None, ring_kv_grads="in_place"))


def test_auto_fit_keeps_a_ring_layout_in_the_command_it_prints():
    """With ring attention (p2p cp 2) the printed command keeps the layout flags and validates as given."""
    argv = [*TINY, "--cp-comm-type", "p2p", "--num-gpus", "2", "--reserve-gib", "0", "--gpu-memory-gib", "0.25",
            "--auto-fit", "--auto-fit-max-traces", "8", "--json"]  # any answer that fits shows the printed layout
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert estimate_memory.main(argv) == 0
    fit = json.loads(out.getvalue())["auto_fit"]
    command = fit["command"]
    assert command[command.index("--cp-comm-type") + 1] == "p2p" and "--cp-impl" not in fit["flags"]
    cfg = parse_config(_with_mock_data(command[5:]))
    cfg.validate(2)
    assert cfg.context_layout().ring_size == 2 and fit["gpu_peak_gib"] <= 0.25


def test_an_untied_answer_is_pipelined_where_the_pipelined_stages_fit():
    """At every budget: the answer of the synchronous search with pipelined Untied stages, at its stage width or
    the widest narrower one (any, for a Ulysses answer) that fits and is predicted faster, else as it was."""
    cfg = parse_config(["--model", "llama3-8b", "--bf16", "--seq-length", "1048576", "--context-parallel-size", "8",
                        "--mock-data"])
    whole = search_space(cfg, 8)
    evaluate = _synthetic(dataclasses.replace(whole, attention=tuple(a for a in whole.attention if not a.overlap)), cfg)
    # Full recompute and offload, where Untied holds less than Ulysses; every attention level.
    space = dataclasses.replace(whole, modes=whole.modes[2:5], mlp_tiles=whole.mlp_tiles[-2:],
                                loss_tiles=whole.loss_tiles[-2:], offload_every=(1,), keep_attention=(False,))
    synchronous = dataclasses.replace(space, attention=tuple(a for a in space.attention if not a.overlap))
    peaks = sorted({evaluate(c.apply(cfg), _machine(GIB, num_gpus=8), 0).gpu_peak_bytes
                    for c in map(space.candidate, space.points())})
    chosen_pipelined = 0
    for budget in peaks:
        machine = _machine(budget, num_gpus=8)
        answer = auto_fit(cfg, machine, evaluate=evaluate, space=synchronous, partial_keep=False).choice
        want = answer
        if answer is not None:
            lean = answer.untied_backward != "fast" or answer.ring_kv_grads != "overlapped"
            for a in (a for a in space.attention if a.impl == "untied_ulysses" and a.overlap and a.lean == lean):
                u = a.heads_per_stage
                piped = dataclasses.replace(answer, cp_impl="untied_ulysses", heads_per_stage=u, untied_overlap=True,
                                            untied_backward=a.untied_backward, ring_kv_grads=a.ring_kv_grads)
                if u <= (answer.heads_per_stage or 32) and _step_s(piped, cfg, machine) < _step_s(answer, cfg, machine) \
                        and evaluate(piped.apply(cfg), machine, 0).fits:
                    want = piped
                    break
        got = auto_fit(cfg, machine, evaluate=evaluate, space=space, partial_keep=False).choice
        assert got == want, budget
        chosen_pipelined += bool(got and got.untied_overlap)
        assert got is None or ("--untied-overlap-stages" in got.flags()) == got.untied_overlap
    assert chosen_pipelined > 0


def test_layouts_are_the_divisors_of_the_gpus_within_the_global_batch():
    """cp over the divisors of the GPU count, all-to-all where the heads allow it (in a node; across nodes in a
    node and a ring across), the ring; the data-parallel rest must divide --global-batch-size when it is given."""
    from megatron_lc.planning.layouts import Layout, search_layouts

    cfg = parse_config(["--model", "llama3-8b", "--seq-length", "1048576", "--mock-data"])
    assert search_layouts(cfg, 16, 8) == [
        Layout(16, "a2a+p2p", (8, 2)), Layout(16, "p2p"), Layout(8, "a2a"), Layout(8, "p2p"), Layout(4, "a2a"),
        Layout(4, "p2p"), Layout(2, "a2a"), Layout(2, "p2p"), Layout(1, "a2a")]
    two = parse_config(["--model", "llama3-8b", "--seq-length", "1048576", "--mock-data", "--global-batch-size", "2"])
    assert [(x.cp, x.comm_type) for x in search_layouts(two, 8, 8)] == [(8, "a2a"), (8, "p2p"), (4, "a2a"),
                                                                          (4, "p2p")]
    three_heads = parse_config(["--model", "debug", "--seq-length", "4096", "--hidden-size", "192",
                                "--num-attention-heads", "3", "--num-query-groups", "3", "--mock-data"])
    assert all(x.comm_type == "p2p" or x.cp in (1, 3) for x in search_layouts(three_heads, 4, 4))


def _layout_synthetic(cfg_seq: int):
    """A planner whose bytes per GPU fall with cp (tokens per GPU) and with every memory choice (the lean backward
    included); the NCCL bytes
    of a group grow with it; offload costs host bytes, 1/k of them."""
    def evaluate(c, machine, seq_length=None):
        p, m = c.parallel, c.memory
        cp = p.context_parallel_size
        tokens = (seq_length or cfg_seq) // cp
        mode = MODES.index((m.recompute_granularity, m.offload_mode))
        per_token = (100 - 15 * mode) / (1 + 0.05 * (m.tiled_mlp_tiles or 0)) / (1 + 0.02 * (m.tiled_loss_tiles or 0))
        per_token *= 0.9 if p.cp_impl == "untied_ulysses" and mode >= 2 else 1
        per_token *= 1.1 if p.cp_comm_type == "p2p" and cp > 1 else 1
        per_token += 12 if m.keep_attention_output and m.offload_mode == "none" else 0
        per_token += 3 if p.untied_overlap_stages else 0
        per_token *= 0.95 if p.untied_backward == "lean" or p.ring_kv_grads == "in_place" else 1
        nccl = 20_000 * cp
        offloads = m.offload_mode != "none"
        host = (tokens * 40 // m.offload_every_k_layers + (tokens * 40 if m.keep_attention_output else 0)
                if offloads else 0)
        by_category = dict.fromkeys(("parameters", "gradients", "optimizer state", "activations",
                                     "communication buffers", "temporaries"), 0)
        by_category["activations"], by_category["communication buffers"] = int(tokens * per_token), nccl
        return Estimate(seq_length or cfg_seq, by_category, nccl, host, "test", [], 0, (1,), machine)
    return evaluate


@pytest.mark.parametrize("tolerance", [0.0, TOLERANCE])
def test_layout_search_answers_the_fastest_layout_and_stack_that_fit(tolerance):
    """Over every layout of 4 GPUs and every stack: the answer per token is within the tolerance of the fastest
    that fits (brute force over the synthetic planner), at budgets from generous to nothing fitting."""
    from megatron_lc.planning.layouts import search_layouts

    cfg = parse_config([*TINY, "--mock-data", "--context-parallel-size", "1"])
    layouts = search_layouts(cfg, 4, 4)
    evaluate = _layout_synthetic(cfg.data.seq_length)
    time_model = TimeModel.for_machine(_machine(GIB), cfg)
    everything = []
    for layout in layouts:
        base = layout.apply(cfg)
        space = search_space(base, 4)
        for point in space.points():
            if not space.attention[point[3]].overlap:
                c = space.candidate(point).apply(base)
                t = time_model.predict(c, 4)
                everything.append((t.step_s / t.tokens, evaluate(c, _machine(GIB))))
    peaks = sorted({e.gpu_peak_bytes for _, e in everything})
    for budget in [peaks[0] - 1, *peaks[:: max(1, len(peaks) // 6)], peaks[-1]]:
        machine = dataclasses.replace(_machine(budget, host_gib=0.004), num_gpus=4)
        fitting = [t for t, e in everything if dataclasses.replace(e, machine=machine).fits]
        calls = []
        result = auto_fit(cfg, machine, time_model, evaluate=lambda *a: calls.append(a) or evaluate(*a),
                          layouts=layouts, tolerance=tolerance, max_traces=100)
        assert (result.choice is None) == (not fitting), budget
        if fitting:
            chosen = result.cost.step_s / result.cost.tokens
            assert result.estimate.fits and min(fitting) <= chosen * (1 + 1e-12)
            assert chosen <= min(fitting) * (1 + tolerance) * (1 + 1e-12), budget
            assert result.layout in layouts and len(result.verdicts) == len(layouts)
        # The lean backward is an attention kind of its own per implementation: up to 80 traces with the tolerance.
        # Where nothing fits with the optimizer on the GPU, the same search with it on the host gets the traces left.
        on_gpu = [a for a in calls if not a[0].optim.optimizer_cpu_offload]
        assert len(on_gpu) <= (80 if tolerance else 100), (budget, len(on_gpu))
        assert not result.capped or (result.choice is None and len(on_gpu) < len(calls)), (budget, len(calls))


def test_auto_fit_without_layout_flags_searches_the_layout_and_prints_it():
    argv = [*TINY[:4], *TINY[6:], "--num-gpus", "4", "--reserve-gib", "0", "--auto-fit", "--json",
            "--planner-cache", "off", "--planner-workers", "1"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert estimate_memory.main(argv) == 0
    fit = json.loads(out.getvalue())["auto_fit"]
    assert fit["layout_searched"] and len(fit["layouts"]) == 5
    command = fit["command"]
    cp = int(command[command.index("--context-parallel-size") + 1])
    assert cp == fit["layout"]["context_parallel_size"]
    parse_config(_with_mock_data(command[5:])).validate(4)


def test_an_offloading_answer_keeps_the_attention_of_as_many_first_blocks_as_the_host_holds():
    """Keeping every block's attention output does not fit the host, keeping none does: the answer keeps those of
    the first N blocks, N the most the host's room holds, traced and predicted faster."""
    from megatron_lc.memory.kept_attention import kept_bytes_per_layer

    cfg = parse_config(["--model", "llama3-8b", "--bf16", "--seq-length", "1048576", "--context-parallel-size", "8",
                        "--mock-data"])
    whole = search_space(cfg, 8)
    space = dataclasses.replace(whole, modes=(("full", "prefetch"),), mlp_tiles=whole.mlp_tiles[-1:],
                                loss_tiles=whole.loss_tiles[-1:], attention=whole.attention[:1], offload_every=(1,))
    tokens = 1048576 // 8
    per_layer = kept_bytes_per_layer(tokens, 32, 128, 2)

    def evaluate(c, machine, seq_length=None):
        stack = c.memory_stack()
        keeping = min(stack.kept_attention_layers(32), stack.offloaded_layers(32))
        host = stack.offloaded_layers(32) * tokens * 4096 * 2 + keeping * per_layer
        by_category = dict.fromkeys(("parameters", "gradients", "optimizer state", "activations",
                                     "communication buffers", "temporaries"), 0)
        by_category["activations"] = 10 * GIB
        return Estimate(1048576, by_category, 0, host, "test", [], 0, (1,), machine)

    inputs_per_node = 31 * tokens * 4096 * 2 * 8
    room = 12.5 * per_layer * 8  # twelve blocks' kept attention fit on the node, not thirteen
    machine = Machine(num_gpus=8, reserve_gib=0, host_reserve_gib=0, host_memory_gib=(inputs_per_node + room) / GIB)
    result = auto_fit(cfg, machine, evaluate=evaluate, space=space)
    assert result.choice.keep_attention and result.choice.keep_attention_layers == 12
    assert result.estimate.fits and "--keep-attention-output-layers" in result.choice.flags()
    plain = auto_fit(cfg, machine, evaluate=evaluate, space=space, partial_keep=False)
    assert not plain.choice.keep_attention and result.cost.step_s < plain.cost.step_s


def test_a_sparse_answer_that_keeps_every_attention_output_reads_it_in_its_replays_and_keeps_its_k():
    """k = 2 with every block keeping fits the host, k = 1 with every block keeping does not. The k = 2 answer's
    replays read the kept outputs (--replay-kept-attention): no attention forward anywhere in its backward, so
    keeping every input (k = 1) and the attention of only the first blocks that fit is predicted slower, and the
    answer stays."""
    from megatron_lc.memory.kept_attention import kept_bytes_per_layer

    cfg = parse_config(["--model", "llama3-8b", "--bf16", "--seq-length", "4194304", "--context-parallel-size", "8",
                        "--mock-data"])
    whole = search_space(cfg, 8)
    space = dataclasses.replace(whole, modes=(("full", "early"),), mlp_tiles=whole.mlp_tiles[-1:],
                                loss_tiles=whole.loss_tiles[-1:], attention=whole.attention[:1], offload_every=(1, 2))
    tokens = 4194304 // 8
    per_layer, per_input = kept_bytes_per_layer(tokens, 32, 128, 2), tokens * 4096 * 2

    def evaluate(c, machine, seq_length=None):
        stack = c.memory_stack()
        keeping = min(stack.kept_attention_layers(32), stack.offloaded_layers(32))
        host = stack.host_slots(32) * per_input + keeping * per_layer
        by_category = dict.fromkeys(("parameters", "gradients", "optimizer state", "activations",
                                     "communication buffers", "temporaries"), 0)
        by_category["activations"] = 10 * GIB
        return Estimate(4194304, by_category, 0, host, "test", [], 0, (1,), machine)

    budget = 8 * (31 * per_input + 21.5 * per_layer)  # k = 1 and 21 blocks' outputs; k = 2 and all 31 (16 + 31)
    machine = Machine(num_gpus=8, reserve_gib=0, host_reserve_gib=0, host_memory_gib=budget / 0.99 / GIB)
    plain = auto_fit(cfg, machine, evaluate=evaluate, space=space, partial_keep=False).choice
    assert (plain.offload_every, plain.keep_attention, plain.keep_attention_layers) == (2, True, None)
    assert "--replay-kept-attention" in plain.flags() and plain.apply(cfg).memory_stack().replay_kept_attention
    result = auto_fit(cfg, machine, evaluate=evaluate, space=space)
    assert result.choice == plain and result.estimate.fits
    partial = dataclasses.replace(plain, offload_every=1, keep_attention_layers=21)  # what the host holds at k = 1
    tm = TimeModel(family="fa3")
    assert tm.predict(partial.apply(cfg), 8).step_s > tm.predict(plain.apply(cfg), 8).step_s


@pytest.mark.parametrize("workers, tolerance", [(1, 0.0), (4, TOLERANCE)])
def test_search_answers_the_fastest_fitting_stack_of_random_monotone_planners(workers, tolerance):
    """Planners whose GPU fit rises with every choice and whose host fit rises with k and falls with kept
    attention (the search's assumptions, nothing more), drawn at random: the answer is the fastest that fits
    (within the tolerance), also when rounds trace several probes at once."""
    import random
    import types

    from megatron_lc.planning.estimate_pool import EstimatePool

    cfg = parse_config(["--model", "debug", "--num-layers", "16", "--hidden-size", "1024", "--ffn-hidden-size", "4096",
                        "--num-attention-heads", "16", "--num-query-groups", "4", "--vocab-size", "32000",
                        "--mock-data", "--seq-length", "262144", "--bf16", "--context-parallel-size", "8"])
    space = search_space(cfg, 8)
    points = [p for p in space.points() if not space.attention[p[3]].overlap]
    by_config = {repr(space.candidate(p).apply(cfg)): p for p in space.points()}
    machine = Machine(num_gpus=8)
    step = {p: _step_s(space.candidate(p), cfg, machine) for p in points}
    for seed in range(100 * workers, 100 * workers + 40):  # 40 planners a parametrization, none twice
        rnd = random.Random(seed)
        w = [rnd.random() for _ in range(5)]
        gpu_bar, host_bar, kept_weight = rnd.uniform(0.5, 2.5), rnd.uniform(0, 2.5), rnd.random()

        def fits(p):
            gpu = w[0] * p[0] / 2.5 + w[1] * p[1] / 5 + w[2] * p[2] / 2 + w[3] * (p[3] % 3) / 2 + w[4] * p[5] >= gpu_bar
            host = space.modes[p[0]][1] == "none" or p[4] + 2 * kept_weight * p[5] >= host_bar
            return gpu, host

        def evaluate(c, machine, seq_length=None):
            gpu, host = fits(by_config[repr(c)])
            return types.SimpleNamespace(seq_length=seq_length, fits=gpu and host, fits_gpu=gpu, fits_host=host,
                                         gpu_peak_bytes=1 if gpu else 2, gpu_budget_bytes=1, nccl_bytes=0,
                                         host_bytes_per_node=1, host_budget_bytes=1, usage=1)

        fitting = [p for p in points if all(fits(p))]
        result = auto_fit(cfg, machine, evaluate=EstimatePool(evaluate, workers=workers), space=space,
                          partial_keep=False, tolerance=tolerance, max_traces=400)
        assert (result.choice is None) == (not fitting), seed
        if fitting:
            best = min(step[p] for p in fitting)
            assert _step_s(result.choice, cfg, machine) <= best * (1 + tolerance) * (1 + 1e-9), seed


def test_auto_fit_searches_layouts_when_the_default_one_does_not_validate():
    """3 GPUs and --global-batch-size 2: no data-parallel split of 3 divides it, cp 3 does; without any layout that
    validates, one line."""
    argv = ["--model", "debug", "--num-gpus", "3", "--seq-length", "6144", "--num-attention-heads", "3",
            "--num-query-groups", "3", "--hidden-size", "192", "--global-batch-size", "2", "--device", "cpu",
            "--auto-fit", "--json", "--planner-cache", "off", "--planner-workers", "1"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert estimate_memory.main(argv) == 0
    fit = json.loads(out.getvalue())["auto_fit"]
    assert fit["layout"]["context_parallel_size"] == 3 and {v["flags"][1] for v in fit["layouts"]} == {"3"}
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert estimate_memory.main([*argv[:5], "4096", *argv[6:]]) == 2  # 4096 tokens do not split 3 ways
    assert "no parallel layout of 3 GPUs validates" in err.getvalue() and len(err.getvalue().splitlines()) == 1


def test_the_recommended_command_keeps_packing_and_plans_it_on_mock_data():
    """--packing documents (a fine-tuning run) is planned like any run, and the command auto-fit prints keeps it."""
    from megatron_lc.planning import search_space
    from megatron_lc.planning.cli import launch_command, parse

    training = ["--model", "debug", "--seq-length", "2048", "--packing", "documents", "--long-documents", "drop",
                "--tiled-mlp", "--data-path", "sft_messages_document"]
    _, cfg = parse(training)
    assert cfg.packing.packing == "documents"
    command = launch_command(Machine(num_gpus=8), search_space.strip_memory_flags(training))
    assert " ".join(command).endswith("--packing documents --long-documents drop --data-path sft_messages_document")


@pytest.mark.parametrize("flags, message", [
    (["--model", "llama-7t"], "--model 'llama-7t': unknown flavour"),
    (["--model", "debug", "--num-query-groups", "3"], "divisible by num_query_groups"),
])
def test_auto_fit_passes_through_an_error_every_layout_shares(flags, message):
    """An error of the configuration itself (every layout refused for it) is that error's line, as without
    --auto-fit, not the layout search's."""
    argv = [*flags, "--num-gpus", "8", "--seq-length", "4096", "--device", "cpu", "--planner-cache", "off"]
    lines = []
    for extra in ([], ["--auto-fit"]):
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            assert estimate_memory.main([*argv, *extra]) == 2
        lines.append(err.getvalue().strip().splitlines())
    assert lines[0] == lines[1] and len(lines[1]) == 1 and message in lines[1][0]


def test_auto_fit_moves_the_optimizer_to_the_host_only_where_nothing_fits_with_it_on_the_gpu():
    """A model whose states outweigh its activations: no stack fits with AdamW on the GPU, and the answer is the
    fastest stack with it on the host (here none: its flag alone)."""
    cfg = parse_config(["--model", "debug", "--seq-length", "512", "--hidden-size", "512", "--ffn-hidden-size", "2048",
                        "--num-attention-heads", "8", "--num-query-groups", "2", "--kv-channels", "64",
                        "--vocab-size", "16384", "--num-layers", "2", "--device", "cpu", "--mock-data"])
    space = search_space(cfg, 2)
    saving = Candidate("full", "on_demand", space.mlp_tiles[-1], space.loss_tiles[-1], None, None)
    plain_on_host = dataclasses.replace(Candidate("none", "none", None, None, None, None), optimizer_on_host=True)
    budget = estimate(plain_on_host.apply(cfg), _machine(100 * GIB)).gpu_peak_bytes * 1.01
    assert estimate(saving.apply(cfg), _machine(100 * GIB)).gpu_peak_bytes > budget  # nothing fits on the GPU
    result = auto_fit(cfg, _machine(budget), max_traces=40)
    assert result.choice == plain_on_host and result.estimate.fits
    assert result.choice.flags() == ["--optimizer-cpu-offload"]
    assert any(not t.candidate.optimizer_on_host for t in result.traced)  # the GPU's search came first
    roomy = auto_fit(cfg, _machine(100 * GIB), max_traces=40)
    assert roomy.choice is not None and not roomy.choice.optimizer_on_host
