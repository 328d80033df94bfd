"""The planner's parts: kernel stand-ins, the length search, the command line."""

import contextlib
import dataclasses
import io
import json
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_lc.planning import cli as estimate_memory
from megatron_lc.arguments import config_from_values, parse_config
from megatron_lc.planning.estimate import GIB, Estimate, Machine, estimate
from megatron_lc.planning.search import find_max_seq_length, length_multiple, stack_layers
from megatron_lc.planning.gpu_allocations import (
    BufferNamer,
    NcclSettings,
    _flash_attn_kernel,
    _sdpa_flash_kernel,
    communicator_bytes,
    connection_bytes,
    nccl_bytes,
    ring_communicator_bytes,
    planned_kernel_name,
)
from megatron_lc.planning.trace import trace_step
from megatron_lc.planning.tracker import CATEGORIES, PlannerMemTracker



def _backward_peak(build, T, H, Hkv, d, cu):
    """(tracked peak of a stand-in kernel's backward, q, its gradients, (k, v)) on fake bf16 inputs."""
    namer = BufferNamer()
    kernel = build(namer)
    with FakeTensorMode():
        q, dout, out = (torch.empty(T, H, d, dtype=torch.bfloat16) for _ in range(3))
        k, v = (torch.empty(T, Hkv, d, dtype=torch.bfloat16) for _ in range(2))
        lse = torch.empty(H, T)
        tracker = PlannerMemTracker()
        namer.tracker = tracker
        with tracker:
            grads = kernel.backward(dout, q, k, v, out, lse, cu)
        return tracker.analyse().peak.total, q, grads, (k, v)


def test_flash_attn_standin_allocates_the_cuda_backward_workspace():
    """dq, dk, dv + fp32 dq accumulator + fp32 row sums + dk/dv expanded to all q heads (GQA)."""
    T, H, Hkv, d = 4096, 4, 1, 128
    peak, q, (dq, dk, dv), (k, v) = _backward_peak(_flash_attn_kernel, T, H, Hkv, d, (0, T))
    rows = T + 128  # one segment: 128 spare rows
    expected = (T * H * d + 2 * T * Hkv * d) * 2 + rows * H * d * 4 + H * rows * 4 + 2 * T * H * d * 2
    assert peak == expected
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape



def test_fa3_standin_allocates_fa3s_backward_workspace_and_is_what_the_planner_traces_with_fa3():
    """hopper/flash_api.cpp's varlen mha_bwd: dq, dk, dv + fp32 softmax_d and softmax_lse_log2 [H, Tq] + fp32 dq
    accumulator [H, Tq * 128] + fp32 dk/dv accumulators [Hkv, Tk, 128] (GQA), Tq and Tk padded by a tile per
    segment; less than flash-attention 2 with GQA (no dk/dv expanded to every q head)."""
    from megatron_lc.planning.gpu_allocations import _fa3_varlen_kernel, planned_kernel_name

    T, H, Hkv, d = 4096, 4, 1, 128
    peak, _, _, _ = _backward_peak(_fa3_varlen_kernel, T, H, Hkv, d, (0, 1000, T))
    q_rows = -(-(T + 2 * 64) // 64) * 64
    k_rows = -(-(T + 2 * 128) // 128) * 128
    expected = (T * H * d + 2 * T * Hkv * d) * 2 + 2 * H * q_rows * 4 + H * q_rows * d * 4 + 2 * Hkv * k_rows * d * 4
    assert peak == expected
    assert planned_kernel_name("auto", "cuda", torch.bfloat16, flash_impl="fa3") == "planned:fa3"
    assert planned_kernel_name("auto", "cuda", torch.bfloat16, flash_impl="default") == "planned:sdpa_flash"
    # A model whose peak is attention's backward (long sequence, small vocabulary): FA3's workspace is what is traced.
    cfg = config_from_values(dict(model="debug", context_parallel_size=2, bf16=True, seq_length=65536,
                                  vocab_size=128, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                                  kv_channels=128, ffn_hidden_size=256, recompute_granularity="full"))
    fa2 = estimate(cfg, Machine(num_gpus=2, reserve_gib=0))
    fa3 = estimate(cfg, Machine(num_gpus=2, reserve_gib=0, fa3=True))
    assert any(name.startswith("FA3 bwd") for name, _, _ in fa3.top_buffers), fa3.top_buffers
    assert not any(name.startswith("FA3") for name, _, _ in fa2.top_buffers)
    assert fa3.gpu_peak_bytes < fa2.gpu_peak_bytes  # GQA: fp32 kv-head accumulators, not 16-bit q-head copies


def _fake_estimate(limit: int):
    """An evaluator whose memory grows a little faster than linearly and fits up to `limit` tokens."""
    def evaluate(cfg, machine, length):
        gpu = int(machine.gpu_memory_gib * GIB * (length / limit) ** 1.1)
        by_category = dict.fromkeys(("parameters", "gradients", "optimizer state", "activations",
                                     "communication buffers", "temporaries"), 0)
        by_category["activations"] = gpu
        return Estimate(length, by_category, 0, 0, "test", [], 0, (1,), machine)
    return evaluate


@pytest.mark.parametrize("limit", [5_000_000, 40_000, 700])
def test_search_returns_the_longest_fitting_multiple(limit):
    cfg = config_from_values(dict(model="debug", context_parallel_size=4))
    machine = Machine(num_gpus=4, gpu_memory_gib=10, reserve_gib=0)
    result = find_max_seq_length(cfg, machine, evaluate=_fake_estimate(limit))
    step = length_multiple(cfg)
    assert result.max_seq_length == (limit // step) * step
    assert len(result.evaluated) < 4 * math.log2(max(limit, step) / step + 2) + 8


def test_search_says_which_memory_stops_the_next_length():
    """GPU memory grows slowly and host memory fast: the host stops the search first, then the GPU alone."""
    cfg = config_from_values(dict(model="debug", context_parallel_size=4))
    on_gpu = _fake_estimate(40_000)

    def with_host(host_limit):
        def evaluate(cfg, machine, length):
            e = on_gpu(cfg, machine, length)
            return dataclasses.replace(e, host_bytes_per_gpu=int(GIB * length / host_limit))
        return evaluate

    machine = Machine(num_gpus=4, gpu_memory_gib=10, reserve_gib=0, host_memory_gib=4, host_reserve_gib=0)
    host_bound = find_max_seq_length(cfg, machine, evaluate=with_host(10_000))
    gpu_bound = find_max_seq_length(cfg, machine, evaluate=with_host(10**9))
    assert host_bound.bound_by == "host" and host_bound.max_seq_length < gpu_bound.max_seq_length
    assert gpu_bound.bound_by == "GPU"


def _run_tool(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert estimate_memory.main(argv) == 0
    return json.loads(out.getvalue())


def test_command_line_json_contract():
    base = ["--model", "debug", "--num-gpus", "2", "--context-parallel-size", "2", "--device", "cpu",
            "--reserve-gib", "0", "--gpu-memory-gib", "0.2", "--json"]
    one = _run_tool([*base, "--seq-length", "1024"])
    assert {"seq_length", "fits", "gpu_peak_gib", "host_peak_gib"} <= one.keys()
    assert one["seq_length"] == 1024 and one["fits"] is True
    searched = _run_tool([*base, "--find-max-seq-length", "--recompute-granularity", "full"])
    assert searched["max_seq_length"] % 1024 == 0 and searched["max_seq_length"] >= 1024
    assert searched["fits"] is True and searched["seq_length"] == searched["max_seq_length"]
    longer = [e for e in searched["evaluated"] if e["seq_length"] == searched["max_seq_length"] + 1024]
    assert longer and not longer[0]["fits"]


def test_stack_table_switches_on_one_layer_per_row():
    # Whatever the user switched on, the table starts from plain FSDP and adds one layer per row.
    cfg = config_from_values(dict(model="debug", recompute_granularity="selective", offload_mode="on_demand",
                                  tiled_mlp=True))
    rows = [(layer.name, layer.config.parallel.context_parallel_size, layer.config.parallel.cp_impl,
             layer.config.memory.recompute_granularity, layer.config.memory.offload_mode,
             layer.config.memory.tiled_mlp and layer.config.memory.tiled_loss)
            for layer in stack_layers(cfg, num_gpus=4)]
    assert rows == [
        ("FSDP", 1, "ulysses", "none", "none", False),
        ("+ Ulysses (cp=4)", 4, "ulysses", "none", "none", False),
        ("+ activation checkpointing", 4, "ulysses", "full", "none", False),
        ("+ CPU offload", 4, "ulysses", "full", "prefetch", False),
        ("+ tiled MLP and loss", 4, "ulysses", "full", "prefetch", True),
        ("+ Untied Ulysses", 4, "untied_ulysses", "full", "prefetch", True),
        ("+ offload fetched on demand", 4, "untied_ulysses", "full", "on_demand", True),
        ("+ lean backward", 4, "untied_ulysses", "full", "on_demand", True),
    ]
    assert [layer.config.parallel.untied_backward for layer in stack_layers(cfg, num_gpus=4)] == ["fast"] * 7 + ["lean"]


def test_nccl_model_reproduces_the_published_all_to_all_measurement():
    """NCCL issue #1685: 1.06 -> 4.34 GB after the first all_to_all_single on 8xH100 (32 channels per peer)."""
    s = NcclSettings()
    all_to_all = communicator_bytes(8, True, s) - communicator_bytes(8, False, s)
    assert all_to_all == pytest.approx(4.34e9 - 1.06e9, rel=0.01)
    assert communicator_bytes(8, False, s) == 32 * connection_bytes(s)  # ring/tree channels only
    assert communicator_bytes(1, True, s) == 0
    half = NcclSettings(buffsize=2 << 20, p2p_channels_per_peer=16)  # what a recipe can lower
    assert communicator_bytes(8, True, half) < communicator_bytes(8, True, s) / 2


def test_planner_models_the_all_to_all_group_and_the_kernel_auto_runs():
    cfg = config_from_values(dict(model="debug", context_parallel_size=2, seq_length=256, mock_data=True))
    trace = trace_step(cfg, 2, 2, "cuda")
    a = trace.analysis
    assert a.all_to_all_groups and all(a.communicator_sizes[g] == 2 for g in a.all_to_all_groups)
    e = estimate(cfg, Machine(num_gpus=2, gpu_memory_gib=80))
    assert e.nccl_bytes == nccl_bytes(a.communicator_sizes, a.all_to_all_groups, NcclSettings()) > 0
    assert planned_kernel_name("auto", "cuda", torch.float32) == "planned:sdpa_efficient"
    assert planned_kernel_name("auto", "cuda", torch.bfloat16) == "planned:sdpa_flash"
    assert planned_kernel_name("auto", "cuda", torch.bfloat16, flash_attn_installed=True) == "planned:flash_attn"
    with pytest.raises(ValueError, match="--bf16"):
        planned_kernel_name("sdpa_flash", "cuda", torch.float32)


def _bare_estimate(machine: Machine, host_per_gpu: int, communicators: int = 1, state_per_gpu: int = 0) -> Estimate:
    return Estimate(1, {"parameters": 0}, 0, host_per_gpu, "test", [], communicators, (1,), machine,
                    state_bytes_per_gpu=state_per_gpu)


def test_default_machine_is_a_dgx_h100_with_the_memory_the_driver_reports():
    m = Machine()
    assert (m.node, m.gpu_memory_gib, m.gpus_per_node, m.host_memory_gib) == ("dgx-h100", 79.11, 8, 1907.0)
    assert Machine(node="dgx-h200").gpu_memory_gib == 139.72
    assert Machine(node="dgx-h200", gpu_memory_gib=100).gpu_memory_gib == 100  # a flag overrides the node
    with pytest.raises(ValueError, match="--machine 'h100'"):
        Machine(node="h100")


def test_gpu_reserve_is_itemized_and_each_term_moves_the_budget():
    pinned = 200 * GIB
    e = _bare_estimate(Machine(), pinned, communicators=3)
    terms = {t.name: t.nbytes for t in e.gpu_reserve_terms}
    assert terms["page tables of page-locked host memory"] == pinned // 4096 * 8
    assert terms["NCCL device structures"] == 3 * 64 * 2**20
    assert terms["NCCL NVLS buffers"] == 0 and terms["model-error margin"] == GIB
    assert e.gpu_budget_bytes == int(79.11 * GIB) - sum(terms.values())
    assert e.to_json()["reserve_gib"] == round(sum(terms.values()) / GIB, 3)
    fragmented = _bare_estimate(Machine(expandable_segments=False), pinned, communicators=3)
    assert e.gpu_budget_bytes - fragmented.gpu_budget_bytes == int(2.9 * GIB)
    nvls = _bare_estimate(Machine(nvls=True), pinned, communicators=3)
    assert e.gpu_budget_bytes - nvls.gpu_budget_bytes == int(0.25 * GIB)
    given = _bare_estimate(Machine(reserve_gib=3.0), pinned)
    assert [t.nbytes for t in given.gpu_reserve_terms] == [3 * GIB]
    assert given.gpu_budget_bytes == int(79.11 * GIB) - 3 * GIB


def test_host_budget_is_the_node_less_its_itemized_terms():
    per_gpu, state = 200 * GIB, 12 * 10**9
    e = _bare_estimate(Machine(), per_gpu, state_per_gpu=state)
    terms = {t.name: t.nbytes for t in e.host_reserve_terms}
    assert terms["struct page"] == int(1907 * GIB) // 4096 * 64  # 1.56% of RAM
    assert terms["driver bookkeeping of page-locked pages"] == 8 * per_gpu // 4096 * 16
    assert terms["checkpoint save staging"] == 8 * state
    assert terms["training processes"] == 8 * 8 * GIB
    assert e.host_budget_bytes == int(1907 * GIB) - sum(terms.values())
    limit = e.host_budget_bytes
    assert _bare_estimate(Machine(host_reserve_gib=128), int(1779 * GIB / 8)).fits_host
    assert not _bare_estimate(Machine(host_reserve_gib=128), int(1780 * GIB / 8)).fits_host
    assert limit < 1779 * GIB  # the itemized host leaves less than the old 128 GiB reserve did


def test_report_prints_every_reserve_term_and_marks_assumptions():
    from megatron_lc.planning.report import estimate_table

    cfg = config_from_values(dict(model="debug", seq_length=256, mock_data=True))
    e = _bare_estimate(Machine(), 10 * GIB)
    e.gpu_bytes_by_category = dict.fromkeys(CATEGORIES, 0)
    text = estimate_table(cfg, e)
    for term in e.gpu_reserve_terms + e.host_reserve_terms:
        assert term.name in text
    assert "* CUDA context" in text and "  struct page" in text and "79.11 GiB (1 x dgx-h100" in text


def test_state_bytes_per_gpu_are_twelve_bytes_per_parameter_over_the_shards():
    from megatron_lc.models.llama import build_model, count_parameters
    from megatron_lc.planning.estimate import state_bytes_per_gpu

    cfg = config_from_values(dict(model="llama3-8b", seq_length=1024, mock_data=True))
    params = count_parameters(build_model(cfg.model_config(), device="meta"))
    assert state_bytes_per_gpu(cfg, 8) == -(-params // 8) * 12
    assert 11.9e9 < state_bytes_per_gpu(cfg, 8) < 12.2e9  # about 12 GB per rank for 8B on 8 GPUs


def test_sdpa_flash_standin_adds_torchs_contiguous_copies_of_strided_grad_out_and_out():
    """torch's flash backward calls .contiguous() on grad_out and out; flash-attn does not copy them."""
    T, H, d = 1024, 2, 64
    peaks = {}
    for name, build in (("flash_attn", _flash_attn_kernel), ("sdpa_flash", _sdpa_flash_kernel)):
        namer = BufferNamer()
        kernel = build(namer)
        with FakeTensorMode():
            received = torch.empty(T, 3 * H, d, dtype=torch.bfloat16)  # q | out | grad_out side by side
            q, out, dout = received[:, :H], received[:, H:2 * H], received[:, 2 * H:]
            k, v = (torch.empty(T, H, d, dtype=torch.bfloat16) for _ in range(2))
            tracker = PlannerMemTracker()
            namer.tracker = tracker
            with tracker:
                kernel.backward(dout, q, k, v, out, torch.empty(H, T), (0, T))
            peaks[name] = tracker.analyse().peak.total
    assert peaks["sdpa_flash"] - peaks["flash_attn"] == 2 * T * H * d * 2


def test_nccl_model_uses_network_channels_for_peers_on_other_nodes():
    s = NcclSettings()
    two_nodes = communicator_bytes(16, True, s, ranks_per_node=8)
    assert two_nodes == (s.channels + 7 * s.p2p_channels_per_peer + 8 * s.net_channels_per_peer) * connection_bytes(s)


def test_ring_attention_groups_are_modelled_as_two_neighbour_connections():
    """A ring's communicator carries only send/recv: connections to its two neighbours (one for a ring of two),
    NVLink channels on one node, network channels across nodes; the trace finds the group by its send/recv."""
    s = NcclSettings()
    assert ring_communicator_bytes(4, s, on_node=True) == 2 * s.p2p_channels_per_peer * connection_bytes(s)
    assert ring_communicator_bytes(2, s, on_node=False) == s.net_channels_per_peer * connection_bytes(s)
    cfg = config_from_values(dict(model="debug", context_parallel_size=4, cp_comm_type="a2a+p2p",
                                  hierarchical_context_parallel_sizes=[2, 2], seq_length=256, mock_data=True,
                                  bf16=True))
    a = trace_step(cfg, 4, 2, "cuda").analysis
    (ring,) = a.point_to_point_groups
    assert a.communicator_sizes[ring] == 2 and ring not in a.all_to_all_groups
    assert all(a.communicator_sizes[g] == 2 for g in a.all_to_all_groups)
    assert nccl_bytes(a.communicator_sizes, a.all_to_all_groups, s, 8, a.point_to_point_groups, False) == \
        nccl_bytes({g: n for g, n in a.communicator_sizes.items() if g != ring}, a.all_to_all_groups, s) + \
        ring_communicator_bytes(2, s, on_node=False)


def test_sdpa_efficient_standin_allocates_each_calls_backward_workspace(monkeypatch):
    """torch's memory-efficient backward allocates an fp32 dq workspace of segments x heads x longest (whole
    128 x 64 tiles) per call; the wrapper's calls over a long document among short ones each stay bounded."""
    from megatron_lc.attention import kernels, varlen
    from megatron_lc.planning.gpu_allocations import efficient_backward_workspace_bytes, planned_kernels

    monkeypatch.setattr(kernels, "EFFICIENT_MIN_ROWS", 0, raising=False)
    cu = (0, *range(2, 302, 2), 812, *range(814, 1114, 2))
    T, H, d = cu[-1], 4, 128
    named = []
    table = planned_kernels(lambda t, name: named.append((name, t.numel() * t.element_size())))
    with FakeTensorMode(allow_non_fake_inputs=True):
        kernel = table[planned_kernel_name("sdpa_efficient", "cuda", torch.float32)]
        q, k, v = (torch.empty(T, H, d) for _ in range(3))
        out, lse, state = kernel.forward(q, k, v, cu)
        kernel.backward(out, q, k, v, out, lse, cu, state=state)
    workspaces = [nbytes for name, nbytes in named if name.startswith("memory-efficient bwd dq")]
    calls = varlen.kernel_calls(cu, None, 2 * T, 128)
    assert len(calls) > 1
    assert workspaces == [efficient_backward_workspace_bytes(len(c.cu_q) - 1, H, varlen.max_seqlen(c.cu_q), d)
                          for c in calls]
    assert max(workspaces) <= 2 * T * H * d * 4 * (1 + 16 / (128 * 64 * 4))  # within twice the tokens' rows
    assert efficient_backward_workspace_bytes(200, 32, 16384, 128) > 53e9  # one call: 200 documents, 16K longest


def test_a_plan_without_any_stack_flag_says_so_in_one_line(capsys):
    """The first command a newcomer types plans plain FSDP; one line on stderr names the stack to plan instead."""
    argv = ["--model", "debug", "--seq-length", "256", "--num-gpus", "2", "--device", "cpu", "--json"]
    assert estimate_memory.main(argv) == 0
    err = capsys.readouterr().err
    assert "planning plain FSDP in fp32 at --context-parallel-size 1 with no memory stack" in err
    assert estimate_memory.STACK_HINT in err
    assert estimate_memory.main([*argv, "--recompute-granularity", "full"]) == 0
    assert "no memory stack" not in capsys.readouterr().err


def _piecewise(limit: int, jump_every: int):
    """Memory linear in the length with a step every `jump_every` tokens (tile counts changing), fitting to `limit`."""
    def evaluate(cfg, machine, length):
        steps = length // jump_every
        usage = 0.2 + 0.75 * length / limit + 0.05 * steps / max(1, limit // jump_every)
        by_category = dict.fromkeys(("parameters", "gradients", "optimizer state", "activations",
                                     "communication buffers", "temporaries"), 0)
        by_category["activations"] = int(machine.gpu_memory_gib * GIB * usage)
        return Estimate(length, by_category, 0, 0, "test", [], 0, (1,), machine)
    return evaluate


def _scan(cfg, machine, evaluate) -> int:
    """The exhaustive answer: every multiple in turn, up to the first that does not fit."""
    step, length = length_multiple(cfg), 0
    while evaluate(cfg, machine, length + step).fits:
        length += step
    return length


@pytest.mark.parametrize("limit,jump", [(50_000, 7_000), (3_000_000, 250_000), (700_000, 1_024), (9_000, 100_000)])
def test_fast_search_returns_the_limit_a_scan_finds_with_piecewise_memory(limit, jump):
    cfg = config_from_values(dict(model="debug", context_parallel_size=2))
    machine = Machine(num_gpus=2, gpu_memory_gib=10, reserve_gib=0)
    evaluate = _piecewise(limit, jump)
    calls = []
    result = find_max_seq_length(cfg, machine, evaluate=lambda *a: calls.append(a) or evaluate(*a))
    assert result.max_seq_length == _scan(cfg, machine, evaluate)
    assert len(calls) <= 16, len(calls)


@pytest.mark.parametrize("flags", [
    ["--recompute-granularity", "full"],
    ["--tiled-mlp", "--tiled-loss", "--context-parallel-size", "2"],
    ["--context-parallel-size", "2", "--recompute-granularity", "full", "--offload-mode", "prefetch"],
])
def test_fast_search_returns_the_limit_a_scan_finds_on_real_traces(flags):
    """On a tiny model traced for real, the rounds of the fast search stop where a scan of every length does."""
    cfg = parse_config(["--model", "debug", "--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "256",
                        "--num-attention-heads", "4", "--num-query-groups", "2", "--vocab-size", "2048",
                        "--device", "cpu", "--mock-data", "--seq-length", "1024", *flags])
    probe = estimate(cfg, Machine(num_gpus=2, reserve_gib=0, device="cpu"), 12 * 1024)
    machine = Machine(num_gpus=2, reserve_gib=0, device="cpu", gpu_memory_gib=probe.gpu_peak_bytes / GIB,
                      host_memory_gib=max(probe.host_bytes_per_node / GIB, 1e-3) * 1.5, host_reserve_gib=0)
    fast = find_max_seq_length(cfg, machine)
    assert fast.max_seq_length == _scan(cfg, machine, estimate) >= 12 * 1024
