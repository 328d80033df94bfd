"""Per-GPU and host memory of a training configuration, the longest context that fits, the predicted step
time, and the fastest memory stack that fits (`--auto-fit`). The command line of `megatron_lc.planning.cli`:

    python tools/estimate_memory.py --model llama3-8b --bf16 --seq-length 5242880 \\
        --context-parallel-size 8 --recompute-granularity full --offload-mode prefetch \\
        --tiled-mlp --tiled-loss --num-gpus 8 --machine dgx-h100

See docs/memory_planner.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lc.planning.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
