"""Every flag changes the run or is refused: a flag that would act on nothing is one line and exit 2, from
the real entry points, before any process group exists."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = [sys.executable, "-m", "megatron_lc.train", "--mock-data", "--seq-length", "64", "--train-iters", "1",
         "--device", "cpu"]

REFUSED = {  # flags: words the one line must hold
    "mlp tiles without tiling": (["--tiled-mlp-tiles", "3"], "--tiled-mlp-tiles 3 sets the tiles of --tiled-mlp"),
    "loss tiles without tiling": (["--tiled-loss-tiles", "3"], "--tiled-loss-tiles 3 sets the tiles of --tiled-loss"),
    "keep-last without offload": (["--recompute-granularity", "full", "--offload-keep-last", "2"],
                                  "--offload-keep-last 2 chooses which offloaded block inputs"),
    "heads per stage with Ulysses": (["--untied-heads-per-stage", "2"],
                                     "--untied-heads-per-stage 2 sets the stages of Untied Ulysses"),
    "FA3 on the CPU": (["--flash-attention-impl", "fa3"], "--flash-attention-impl fa3 replaces torch's flash"),
    "FA3 with another kernel": (["--flash-attention-impl", "fa4", "--attention-kernel", "reference"],
                                "--attention-kernel reference does not use"),
    "rope factor without rope scaling": (["--rope-scaling-factor", "4"], "--rope-scaling-factor sets rotary scaling, "
                                         "which this model does not use: add --use-rope-scaling"),
    "yarn's beta on llama3 scaling": (["--model", "llama3-8b", "--rope-scaling-beta-fast", "16"],
                                      "--rope-scaling-beta-fast is yarn scaling's, not llama3's"),
    "rotary base zero": (["--rotary-base", "0"], "--rotary-base 0 must be > 0"),
    "original positions with dynamic NTK": (["--use-rope-scaling", "--rope-scaling-type", "dynamic",
                                             "--rope-scaling-original-max-position-embeddings", "64"],
                                            "is not read by dynamic scaling"),
    "dynamic NTK with positions reset per document": (["--use-rope-scaling", "--rope-scaling-type", "dynamic",
                                                       "--reset-position-ids"], "scales by the sample length"),
    "rotary base negative": (["--rotary-base", "-10000"], "--rotary-base -10000 must be > 0"),
    "on-demand fetch without offload": (["--recompute-granularity", "full", "--no-offload-prefetch"],
                                        "--no-offload-prefetch changes how offloaded block inputs come back"),
    "two offload modes": (["--recompute-granularity", "full", "--offload-activations", "--no-offload-prefetch",
                           "--offload-prefetch-early"], "contradict each other"),
    "offload without full recompute": (["--offload-mode", "prefetch"], "--offload-mode prefetch offloads"),
    "replays reading kept attention without sparse offload": (
        ["--recompute-granularity", "full", "--offload-mode", "prefetch", "--keep-attention-output",
         "--replay-kept-attention"], "--replay-kept-attention rebuilds sparse offload's block inputs"),
}


def _one_line_exit_2(command: list[str], words: str) -> None:
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    lines = [line for line in out.stderr.splitlines() if line.strip() and "Warning" not in line
             and not line.startswith("  ")]
    assert len(lines) == 1 and "error: " in lines[0] and words in lines[0], out.stderr
    assert "Traceback" not in out.stderr and "step" not in out.stdout


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_flag_that_would_act_on_nothing_is_refused_in_one_line(case):
    flags, words = REFUSED[case]
    _one_line_exit_2(TRAIN + flags, words)


def test_auto_fit_refuses_a_recompute_method_it_would_replace():
    _one_line_exit_2([sys.executable, "tools/estimate_memory.py", "--model", "debug", "--num-gpus", "2",
                      "--seq-length", "256", "--auto-fit", "--recompute-granularity", "full", "--recompute-method",
                      "block", "--recompute-num-layers", "1"], "--auto-fit chooses the recompute of every block")


def test_help_offers_only_choices_the_parser_takes():
    out = subprocess.run([sys.executable, "-m", "megatron_lc.train", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "{None" not in out.stdout and ",None" not in out.stdout
    assert "--offload-mode {none,on_demand,prefetch,early}" in out.stdout
    assert "--offload-activations" not in out.stdout  # an old spelling, accepted, not offered


def test_old_offload_spellings_still_train():
    out = subprocess.run(TRAIN + ["--num-layers", "2", "--recompute-granularity", "full", "--offload-activations",
                                  "--offload-prefetch-early", "--log-dir", "/dev/null/x"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--log-dir /dev/null/x: not writable" in out.stderr  # past every flag rule
