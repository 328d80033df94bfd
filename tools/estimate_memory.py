"""Per-GPU and host memory of a training configuration, the longest context that fits, the predicted step
time, and the fastest memory stack that fits (`--auto-fit`). The command line of `megatron_lc.planning.cli`:

    python tools/estimate_memory.py --model llama3-8b --bf16 --seq-length 5242880 \\
        --context-parallel-size 8 --recompute-granularity full --offload-mode prefetch \\
        --tiled-mlp --tiled-loss --num-gpus 8 --machine dgx-h100

A command line answered before (the same flags, code and files) is printed from the plan cache before torch
is imported (`megatron_lc/plan_cache.py`). See docs/memory_planner.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lc.plan_cache import answered  # noqa: E402  (the standard library only)


def plan(argv: list[str]) -> int:
    from megatron_lc.planning.cli import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(answered(sys.argv[1:], plan))
