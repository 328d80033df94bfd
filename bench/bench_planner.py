"""The planner's goals, timed: cold (an empty plan cache) and warm (the same call again), beside `--exact`.

    python bench/bench_planner.py [--goals NAME ...] [--exact] [--workers N] [--out FILE.json]

Each goal is one `tools/estimate_memory.py ... --json` command line (auto-fit at a length, a longest-length
search, or one estimate), run as a user runs it, in a new process: its wall seconds include starting Python
and importing torch. Cold: a new, empty `--planner-cache` directory; warm: the same call again, answered from
that cache. With `--exact`, each goal is also run cold with `--exact` (every rank of Untied Ulysses'
per-rank loops traced) and the two answers compared: layout and stack flags, the longest length, GPU and host
bytes, the predicted step. One line per run as it ends, then a table; `--out` keeps every answer as JSON.
Times depend on the machine and what else runs on it: the table says how many cores this process may use and
the load average at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DGX = ["--bf16", "--machine", "dgx-h100"]
LEAN_16 = ["--model", "llama3-8b", "--num-gpus", "16", "--context-parallel-size", "16", "--cp-comm-type", "a2a+p2p",
           "--hierarchical-context-parallel-sizes", "8", "2", "--cp-impl", "untied_ulysses",
           "--recompute-granularity", "full", "--offload-mode", "on_demand", "--tiled-mlp", "--tiled-loss",
           "--with-flash-attn", "--offload-every-k-layers", "2", "--untied-backward", "lean",
           "--ring-kv-grads", "in_place"]
FULL_STACK_8B = ["--model", "llama3-8b", "--num-gpus", "8", "--context-parallel-size", "8", "--cp-impl",
                 "untied_ulysses", "--recompute-granularity", "full", "--offload-mode", "prefetch", "--tiled-mlp",
                 "--tiled-loss"]
GOALS: dict[str, list[str]] = {
    # One estimate: the planner's unit, what every search is made of.
    "8b-8 2M one estimate": [*FULL_STACK_8B, *DGX, "--seq-length", "2097152"],
    # The README's longest-length search.
    "8b-8 find-max": [*FULL_STACK_8B, *DGX, "--find-max-seq-length"],
    "8b-16 lean find-max": [*LEAN_16, *DGX, "--find-max-seq-length"],
    **{f"8b-8 {name} FA3 auto-fit": ["--model", "llama3-8b", "--num-gpus", "8", *DGX, "--seq-length", str(tokens),
                                     "--with-fa3", "--auto-fit"]
       for name, tokens in (("1M", 1 << 20), ("2M", 2 << 20), ("4M", 4 << 20), ("5M", 5 << 20))},
    "sft 8b-8 packed 1M auto-fit": ["--model", "llama3-8b", "--num-gpus", "8", *DGX, "--seq-length", str(1 << 20),
                                    "--packing", "documents", "--reset-attention-mask", "--with-fa3", "--auto-fit"],
    "32b-8 2.5M auto-fit": ["--model", "llama-32b", "--num-gpus", "8", *DGX, "--seq-length", "2621440", "--auto-fit"],
    "70b-8 512K auto-fit": ["--model", "llama3-70b", "--num-gpus", "8", *DGX, "--seq-length", "524288", "--auto-fit"],
    "70b-32 5M auto-fit": ["--model", "llama3-70b", "--num-gpus", "32", *DGX, "--seq-length", "5242880", "--auto-fit"],
    "70b-64 12M auto-fit": ["--model", "llama3-70b", "--num-gpus", "64", *DGX, "--seq-length", "12582912",
                            "--auto-fit"],
}


def answer_of(out: dict) -> dict:
    """What a goal answers: the layout and stack (auto-fit), the longest length (find-max), bytes and step."""
    fit = out.get("auto_fit")
    source = fit if fit is not None else out
    time_s = (source.get("time") or {}).get("step_s")
    answer = {"fits": source.get("fits"), "gpu_peak_gib": source.get("gpu_peak_gib"),
              "host_peak_gib": source.get("host_peak_gib"), "step_s": time_s}
    if fit is not None:
        answer.update(flags=(fit.get("layout") or {}).get("flags", []) + (fit.get("flags") or []),
                      traces=len(fit.get("traced", [])))
    if "max_seq_length" in out:
        answer.update(max_seq_length=out["max_seq_length"], traces=len(out.get("evaluated", [])))
    return answer


def run(argv: list[str], cache: Path, workers: int | None) -> tuple[float, dict]:
    """(wall seconds, answer) of one planner command line."""
    command = [sys.executable, str(ROOT / "tools" / "estimate_memory.py"), *argv, "--json",
               "--planner-cache", str(cache)] + (["--planner-workers", str(workers)] if workers else [])
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):  # 1: nothing fits, still an answer
        raise SystemExit(f"{' '.join(argv)}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return seconds, answer_of(json.loads(done.stdout))


def same(a: dict, b: dict) -> bool:
    """The same answer: flags, length and fit equal; bytes within 0.1%, the step within 0.5%."""
    def close(x, y, rel):
        return x == y or (x is not None and y is not None and abs(x - y) <= rel * max(abs(x), abs(y)))
    return (a.get("flags") == b.get("flags") and a.get("max_seq_length") == b.get("max_seq_length")
            and a["fits"] == b["fits"] and close(a["gpu_peak_gib"], b["gpu_peak_gib"], 1e-3)
            and close(a["host_peak_gib"], b["host_peak_gib"], 1e-3) and close(a["step_s"], b["step_s"], 5e-3))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--goals", nargs="+", choices=sorted(GOALS), default=list(GOALS), metavar="NAME",
                   help=f"goals to run (default: all): {'; '.join(GOALS)}")
    p.add_argument("--exact", action="store_true", help="also run each goal cold with --exact and compare")
    p.add_argument("--workers", type=int, default=None, help="--planner-workers (default: the planner's)")
    p.add_argument("--out", default=None, help="write every answer to this JSON file")
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load_start = os.getloadavg()[0]
    rows = []
    for name in args.goals:
        with tempfile.TemporaryDirectory() as fresh, tempfile.TemporaryDirectory() as fresh_exact:
            cold_s, cold = run(GOALS[name], Path(fresh), args.workers)
            print(f"{name}: cold {cold_s:.1f} s {cold}", flush=True)
            warm_s, warm = run(GOALS[name], Path(fresh), args.workers)
            print(f"{name}: warm {warm_s:.1f} s", flush=True)
            row = {"goal": name, "cold_s": round(cold_s, 1), "warm_s": round(warm_s, 1), "answer": cold,
                   "warm_same": same(cold, warm)}
            if args.exact:
                exact_s, exact = run([*GOALS[name], "--exact"], Path(fresh_exact), args.workers)
                print(f"{name}: --exact cold {exact_s:.1f} s {exact}", flush=True)
                row.update(exact_s=round(exact_s, 1), exact=exact, exact_same=same(cold, exact))
            rows.append(row)
    print(f"\n{cores} cores; load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end\n")
    print("| goal | cold s | warm s | --exact cold s | same answer as --exact | traces | answer |")
    print("| --- | ---: | ---: | ---: | --- | ---: | --- |")
    for r in rows:
        a = r["answer"]
        what = (f"{a['max_seq_length']:,} tokens" if "max_seq_length" in a else
                " ".join(a.get("flags") or []) or ("fits" if a["fits"] else "nothing fits"))
        print(f"| {r['goal']} | {r['cold_s']} | {r['warm_s']} | {r.get('exact_s', '-')} | "
              f"{r.get('exact_same', '-')} | {a.get('traces', 1)} | {what}; GPU {a['gpu_peak_gib']} GiB, host/node "
              f"{a['host_peak_gib']} GiB, step {a['step_s']} s |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
