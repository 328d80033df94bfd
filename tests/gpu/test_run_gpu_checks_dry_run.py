"""The GPU check's dry run: every section on CPU at tiny sizes, through the same code, in a subprocess."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("run_gpu_checks.py")
SECTIONS = ("kernels", "single_gpu", "cp_rank", "ratios")


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
    assert set(ratios) >= {"checkpoint", "offload_prefetch", "offload_on_demand", "full_stack",
                           "untied_over_ulysses_cp_rank"}


def test_a_failing_section_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    sys.path.insert(0, str(SCRIPT.parent))
    import run_gpu_checks

    def broken(_sizes):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(run_gpu_checks, "section_kernels", broken)
    results = run_gpu_checks.main(["--dry-run", "--out", str(tmp_path), "--sections", "kernels,cp_rank"])
    assert results["kernels"]["ok"] is False and "planted failure" in results["kernels"]["error"]
    assert results["cp_rank"]["ok"] is True
    written = json.loads((tmp_path / "gpu_checks.json").read_text())
    assert written["kernels"]["ok"] is False and written["cp_rank"]["ok"] is True
