"""The GPU check's dry run: every section on CPU at tiny sizes, through the same code, in a subprocess."""

import json
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).with_name("run_gpu_checks.py")
SECTIONS = ("nccl", "kernels", "kernel_cases", "contracts", "single_gpu", "cp_rank", "ratios")


def test_dry_run_writes_every_section(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
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
        assert {"num_alloc_retries", "reserved_peak_bytes"} <= run["measured"].keys()
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
    assert contracts["offload_bitwise"]["k1"]["bitwise_equal"] and contracts["offload_bitwise"]["k2"]["bitwise_equal"]
    env = results["environment"]
    assert {"nccl_version", "NCCL_NVLS_ENABLE", "host_memory_stats_keys", "gpu_total_bytes"} <= env.keys()
    assert "expandable_segments:True" in env["PYTORCH_CUDA_ALLOC_CONF"]


def test_a_failing_section_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    run_gpu_checks = _script()

    def broken(_sizes):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(run_gpu_checks, "section_kernels", broken)
    results = run_gpu_checks.main(["--dry-run", "--out", str(tmp_path), "--sections", "kernels,cp_rank"])
    assert results["kernels"]["ok"] is False and "planted failure" in results["kernels"]["error"]
    assert results["cp_rank"]["ok"] is True
    written = json.loads((tmp_path / "gpu_checks.json").read_text())
    assert written["kernels"]["ok"] is False and written["cp_rank"]["ok"] is True


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
