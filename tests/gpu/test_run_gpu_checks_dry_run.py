"""The GPU check's dry run: every section on CPU at tiny sizes, through the same code, in a subprocess."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("run_gpu_checks.py")
SECTIONS = ("nccl", "kernels", "kernel_cases", "contracts", "single_gpu", "cp_rank", "ratios", "model_steps")


def test_dry_run_writes_every_section(tmp_path):
    # one thread, as every process the tests start: they share two cores (more threads spin on them)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "gpu_checks.json").read_text())
    failed = {name: results.get(name, {}).get("traceback", "missing") for name in SECTIONS
              if not results.get(name, {}).get("ok")}
    assert not failed, failed
    assert (tmp_path / "gpu_checks.log").read_text().count(": ok in") == len(SECTIONS)
    kernel_runs = results["kernels"]["result"]
    assert {"cpu_flash", "auto_bfloat16", "auto_float32", "unmasked_cpu_flash", "unmasked_auto_bfloat16"} <= kernel_runs.keys()
    assert all(run["within_tolerance"] for run in kernel_runs.values())
    # On CPU the planner traces the CPU kernels as they are: its prediction is the measured peak
    # (measured: 0.9983-0.9990 in bf16).
    for run in [*results["single_gpu"]["result"].values(), *results["cp_rank"]["result"].values()]:
        assert abs(run["predicted_over_measured"] - 1) < 0.01, run
        assert abs(run["host_predicted_over_measured"] - 1) < 0.001, run
    ratios = results["ratios"]["result"]["ratio_to_no_stack"]
    assert set(ratios) >= {"checkpoint", "offload_prefetch", "offload_on_demand", "offload_prefetch_early", "full_stack",
                           "untied_over_ulysses_cp_rank_compute_only"}
    for run in results["cp_rank"]["result"].values():  # the fake group moves nothing: no plain timing figure
        assert "compute_only_step_seconds" in run["measured"] and "compute_only_tokens_per_s" in run
        assert not {"step_seconds", "tokens_per_s", "mfu"} & (run.keys() | run["measured"].keys())
    for run in results["single_gpu"]["result"].values():
        assert {"num_alloc_retries", "reserved_peak_bytes", "compute_only_step_seconds"} <= run["measured"].keys()
        assert {"compute_only_tokens_per_s", "compute_only_mfu"} <= run.keys()
    first_use = results["nccl"]["result"]["first_use"]
    assert all("event" in first_use[k] for k in ("init_process_group", "all_reduce", "all_gather",
                                                  "reduce_scatter", "all_to_all"))
    assert "error" in first_use["send_recv"]  # gloo has no send to itself; NCCL has
    events = [e["event"] for e in results["memory_timeline"]]
    assert events[0] == "after CUDA init" and "after first all_to_all" in events
    cases = results["kernel_cases"]["result"]
    assert cases["failures"] == []
    assert cases["strided_efficient"]["bfloat16"]["within_tolerance"]
    assert cases["strided_efficient"]["bfloat16"]["strides"]["q"][0] == 3 * 8 * 16  # a column slice of q|k|v
    assert cases["many_segments"]["segments"] == 300 and cases["many_segments"]["cpu_flash"]["within_tolerance"]
    workspace = cases["efficient_workspace"]
    assert workspace["measured_backward_peak_bytes"] > 0 and workspace["modelled_backward_peak_bytes"] > 0
    contracts = results["contracts"]["result"]
    assert contracts["flash_impl"] == "default" and contracts["probe"] == "ok"
    offload = contracts["offload_bitwise"]
    assert offload["baseline"] == {"deterministic_algorithms": True, "bitwise_reproducible": True, "max_spread": 0.0}
    assert offload["k1"]["bitwise_equal"] and offload["k2"]["bitwise_equal"] and offload["failures"] == []
    steps = results["model_steps"]["result"]
    assert steps["failures"] == []
    host = steps["host_optimizer"]  # on CPU the host optimizer's arithmetic is the resident one's
    assert host["bitwise_equal"] and host["optimizer_host_bytes"] > 0
    assert 1 <= host["planned_over_measured_host"] < 1.05  # the plan adds the host step's scratch
    # measured from the buffers' storages: on CPU nothing is page-locked, and they hold what the optimizer counts
    assert host["allocated_host_bytes"] == host["optimizer_host_bytes"] + host["offload_host_bytes"]
    assert host["unpinned_host_buffers"] is None
    assert steps["replay_kept_attention"]["bitwise_equal"]
    assert steps["replay_kept_attention"]["arenas_made_in_steps"] == []  # kept attention's reserved at start-up
    assert steps["replay_kept_attention"]["reserved_host_bytes"] > 0
    assert abs(steps["ring"]["predicted_over_measured"] - 1) < 0.01
    assert steps["packed_documents"]["documents_per_sample"] == 8
    env = results["environment"]
    assert {"nccl_version", "NCCL_NVLS_ENABLE", "host_memory_stats_keys", "gpu_total_bytes"} <= env.keys()
    assert "expandable_segments:True" in env["PYTORCH_CUDA_ALLOC_CONF"]


def test_a_failing_section_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    run_gpu_checks = _script()

    def broken(_sizes):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(run_gpu_checks, "section_kernels", broken)
    # the section after it: one of the quick ones (the dry run above checks every section's result)
    results = run_gpu_checks.main(["--dry-run", "--out", str(tmp_path), "--sections", "kernels,kernel_cases"])
    assert results["kernels"]["ok"] is False and "planted failure" in results["kernels"]["error"]
    assert results["kernel_cases"]["ok"] is True
    written = json.loads((tmp_path / "gpu_checks.json").read_text())
    assert written["kernels"]["ok"] is False and written["kernel_cases"]["ok"] is True


def _script():
    sys.path.insert(0, str(SCRIPT.parent))
    import run_gpu_checks

    return run_gpu_checks


def test_page_locking_is_recorded_before_and_after_each_registration():
    checks = _script()
    timeline, locked = checks.MemoryTimeline("cpu"), []
    checks.recording_page_lock(locked.append, timeline)(buffer := torch.empty(10, dtype=torch.float32))
    assert locked == [buffer]
    assert [(e["event"], e["host_bytes"]) for e in timeline.events] == [("before page-locking", 40),
                                                                      ("after page-locking", 40)]


def test_cases_are_sized_to_the_card_or_skipped_with_the_reason(monkeypatch):
    checks = _script()
    h100 = int(79.11 * 2**30)  # what the driver reports for an "80 GB" H100 (docs/memory_planner.md)
    assert checks.skip_reason(70 * 2**30, 0, h100, 2**40) is None
    assert "the card has 79.1 GiB" in checks.skip_reason(80 * 2**30, 0, h100, 2**40)
    assert "host memory" in checks.skip_reason(0, 2**40, h100, 2**40)
    assert checks.skip_reason(2**50, 0, None, 2**40) is None  # not a GPU run: nothing to size
    monkeypatch.setattr(checks, "device_total_bytes", lambda s: 2**20)  # a 1 MiB card: nothing fits
    s = checks.sizes(dry_run=True)
    assert "device memory" in checks.case_many_segments(s)["skipped"]
    assert "device memory" in checks.case_efficient_workspace(s)["skipped"]
    row = checks.compare(checks.config(s, 256, checks.FULL_STACK), 1, s)
    assert "device memory" in row["skipped"] and "measured" not in row


def test_host_memory_stats_keys_are_torchs():
    """The keys read from torch.cuda.host_memory_stats() are the ones its docstring lists (torch 2.11 and on);
    the names read before (reserved_bytes, segment) are not there."""
    doc = torch.cuda.host_memory_stats.__doc__
    for key in _script().HOST_STATS_KEYS:
        assert f'"{key.split(".")[0]}.{{current,peak,allocated,freed}}"' in doc, key
    assert "reserved_bytes" not in doc and "segment" not in doc


def test_a_section_listing_failures_is_failed_with_its_figures_kept(tmp_path, monkeypatch):
    checks = _script()
    monkeypatch.setattr(checks, "section_kernel_cases", lambda s: {"many_segments": {"x": 1}, "failures": ["x"]})
    results = checks.main(["--dry-run", "--out", str(tmp_path), "--sections", "kernel_cases"])
    assert results["kernel_cases"]["ok"] is False and results["kernel_cases"]["result"]["many_segments"] == {"x": 1}


# --- a first GPU run reports only real defects ----------------------------------------------------------


def _noisy_steps(checks, monkeypatch, offload_error: float = 0.0):
    """A stand-in for one step's loss and gradients as a GPU gives them: fp32-atomic noise of up to 1e-6 in every
    run (a nondeterministic kernel; the largest of many elements' differences, as in a real gradient, varies
    little from run to run), plus `offload_error` in runs with offload; records whether torch's deterministic
    algorithms were on."""
    calls, g = [], torch.Generator().manual_seed(0)

    def step(cfg, s):
        calls.append((cfg.memory.offload_mode, torch.are_deterministic_algorithms_enabled()))
        noise = lambda: 1e-6 * torch.rand(4096, generator=g, dtype=torch.float64)  # noqa: E731
        error = offload_error if cfg.memory.offload_mode != "none" else 0.0
        return torch.tensor(2.0) + error, [1 + noise() + error, noise()]

    monkeypatch.setattr(checks, "step_loss_and_grads", step)
    return calls


def test_offload_check_runs_deterministically_and_reads_kernel_noise_as_noise(monkeypatch):
    """Without offload the flash backward's fp32 atomics make two identical runs differ; a correct offload must
    not be reported as failing (which reads as a stream race). The check runs under torch's deterministic
    algorithms, restored after, and holds offload to the baseline's own spread where the baseline is not bitwise."""
    checks = _script()
    calls = _noisy_steps(checks, monkeypatch)
    result = checks.case_offload_bitwise(checks.sizes(dry_run=True))
    assert result["failures"] == [] and not result["baseline"]["bitwise_reproducible"]
    assert result["k1"]["within_baseline_spread"] and not result["k1"]["bitwise_equal"]
    assert [mode for mode, _ in calls] == ["none", "none", "early", "early"]
    assert all(deterministic for _, deterministic in calls) and not torch.are_deterministic_algorithms_enabled()


def test_offload_check_fails_a_difference_beyond_the_baseline_spread(monkeypatch):
    checks = _script()
    _noisy_steps(checks, monkeypatch, offload_error=1e-4)  # a stale block input: far past the kernel's noise
    result = checks.case_offload_bitwise(checks.sizes(dry_run=True))
    assert result["failures"] == ["offload_k1", "offload_k2"] and not result["k1"]["within_baseline_spread"]


def test_a_sanitized_subprocess_past_its_timeout_is_that_cases_failure(tmp_path, monkeypatch):
    checks = _script()

    def too_slow(command, timeout, **kwargs):
        assert kwargs["env"]["TORCH_CUDA_SANITIZER"] == "1" and kwargs["env"]["CUBLAS_WORKSPACE_CONFIG"]
        raise subprocess.TimeoutExpired(command, timeout, stderr=b"step 1 of 4")

    monkeypatch.setattr(checks.subprocess, "run", too_slow)
    gpu = dataclasses.replace(checks.sizes(dry_run=True), device="cuda")
    result = checks.sanitized_offload_bitwise(gpu, tmp_path, timeout_s=120)
    assert result["failures"] == ["sanitized subprocess: no result within 120 s"]
    assert result["stderr_tail"] == "step 1 of 4"


def test_contracts_keep_every_case_when_one_raises(tmp_path, monkeypatch):
    """A case that raises (a timeout nothing caught, before) is that case's failure; the flash probe and the
    allocator's figures stay in the section's result."""
    checks = _script()

    def raises(s, out, timeout_s):
        assert 60 <= timeout_s <= checks.SECTION_BUDGET_S  # what is left of the section's budget
        raise subprocess.TimeoutExpired("sanitized", timeout_s)

    monkeypatch.setattr(checks, "sanitized_offload_bitwise", raises)
    result = checks.section_contracts(checks.sizes(dry_run=True), tmp_path)
    assert result["probe"] == "ok" and result["allocator"] == {"skipped": "CUDA only"}
    assert result["failures"] == ["offload_bitwise: TimeoutExpired"]
    assert "timed out" in result["offload_bitwise"]["error"]


class FakeFlashRegistry:
    """torch.nn.attention's flash registry as on an H100 with FA3 installed: what is active, and restore."""

    def __init__(self):
        self.current = None

    def install(self, monkeypatch):
        attention = torch.nn.attention
        monkeypatch.setattr(attention, "current_flash_attention_impl", lambda: self.current, raising=False)
        monkeypatch.setattr(attention, "activate_flash_attention_impl", self.activate, raising=False)
        monkeypatch.setattr(attention, "restore_flash_attention_impl", self.restore, raising=False)

    def activate(self, name):
        self.current = name

    def restore(self, _raise_warn=True):
        self.current = None


def test_contracts_restore_torchs_flash_kernels_and_the_planner_models_what_runs(tmp_path, monkeypatch):
    """The contracts section activates FA3 (`auto` on an H100 with it installed); the sections after it must run
    torch's default kernels again, and every case's configuration must name what runs, so that the planner
    models the kernel that is timed."""
    checks = _script()
    registry = FakeFlashRegistry()
    registry.install(monkeypatch)
    real_activate = checks.flash_impl.activate_flash_impl

    def activate(name, device, **kwargs):  # `auto` on an H100 with FA3: registered, probed, kept
        if name == "auto":
            torch.nn.attention.activate_flash_attention_impl("FA3")
            return "fa3"
        return real_activate(name, device, **kwargs)

    monkeypatch.setattr(checks.flash_impl, "activate_flash_impl", activate)
    monkeypatch.setattr(checks, "sanitized_offload_bitwise", lambda s, out, timeout_s: {"failures": []})
    s = checks.sizes(dry_run=True)
    result = checks.section_contracts(s, tmp_path)
    assert result["flash_impl"] == "fa3" and result["failures"] == []
    assert registry.current is None and checks.flash_impl.active_flash_impl() == "default"
    assert checks.config(s, 256, checks.FULL_STACK).parallel.flash_attention_impl == "default"
    registry.current = "FA3"  # whatever is active is what a case's configuration, so its prediction, names
    assert checks.config(s, 256, checks.FULL_STACK).parallel.flash_attention_impl == "fa3"


def test_measured_steps_run_fsdps_bf16_policy_as_a_multi_gpu_run(monkeypatch):
    """bf16 by autocast over fp32 parameters keeps the residual stream, the offloaded block inputs and the arenas
    in fp32; a multi-GPU run gets bf16 from FSDP's policy. The measured step must take the multi-GPU path."""
    checks = _script()
    seen, real = [], checks.run_tracked_step

    def tracked(tracker, model, *args, **kwargs):
        hook = model.layers[0].register_forward_pre_hook(
            lambda module, inputs: seen.append((inputs[0].dtype, torch.is_autocast_enabled("cpu"))))
        try:
            return real(tracker, model, *args, **kwargs)
        finally:
            hook.remove()

    monkeypatch.setattr(checks, "run_tracked_step", tracked)
    s = checks.sizes(dry_run=True)
    row = checks.compare(checks.config(s, 128, checks.FULL_STACK), checks.WORLD_SIZE, s)
    assert seen and set(seen) == {(torch.bfloat16, False)}
    assert row["measured"]["offload_host_bytes"] == 3 * 128 * 64 * 2  # three bf16 block inputs of the debug model


def test_each_section_fits_its_budget_and_runs_alone(tmp_path):
    """On one H100 every section must finish in SECTION_BUDGET_S: its GPU compute by the time model (a floor)
    within half of it, the rest for traces, builds and start-up; each section is printed as a command of its own."""
    checks = _script()
    compute = checks.compute_seconds(checks.sizes(dry_run=False))
    assert set(compute) == {"single_gpu", "cp_rank", "ratios", "contracts", "model_steps"}
    for name in checks.SECTIONS:
        assert compute.get(name, 0) <= checks.SECTION_ESTIMATES_S[name] / 2, (name, compute)
        assert checks.SECTION_ESTIMATES_S[name] <= checks.SECTION_BUDGET_S
    commands = checks.section_commands(tmp_path)
    assert [c.split("--sections ")[1].split()[0] for c in commands] == list(checks.SECTIONS)
    assert all(f"--out {tmp_path / name}" in c for c, name in zip(commands, checks.SECTIONS))
    with pytest.raises(SystemExit):
        checks.main(["--dry-run", "--out", str(tmp_path), "--sections", "kernels,cp"])


def test_a_section_past_its_budget_is_marked_and_keeps_its_result(tmp_path, monkeypatch):
    checks = _script()
    monkeypatch.setattr(checks, "SECTION_BUDGET_S", -1)
    results = checks.main(["--dry-run", "--out", str(tmp_path), "--sections", "nccl"])
    assert results["nccl"]["ok"] and results["nccl"]["over_budget"]
