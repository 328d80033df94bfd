"""Convert a Hugging Face LlamaForCausalLM directory to a checkpoint this trainer loads with --load.

    python tools/checkpoint/convert_from_hf.py --load HF_DIR --save CKPT [--force]

The result is weights-only: training from it starts at step 0 (continued pretraining). A config
field the model does not compute exactly is refused in one line (exit status 2), as is a --save
that already holds checkpoints unless --force.
"""

import argparse

from megatron_lc.config import ConfigError
from megatron_lc.entry import run_entry_point
from megatron_lc.models.llama.conversion import hf_to_checkpoint
from megatron_lc.models.llama.hf import UnsupportedHFConfig


def convert(args) -> None:
    try:
        print(f"wrote {hf_to_checkpoint(args.load, args.save, force=args.force)}")
    except UnsupportedHFConfig as e:
        raise ConfigError(f"--load {args.load}: {e}") from e


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="Hugging Face model directory")
    p.add_argument("--save", required=True, help="checkpoint root to write (empty, or new)")
    p.add_argument("--force", action="store_true", help="add iter_0000000 to a --save that holds checkpoints; "
                   "the marker keeps naming their latest step")
    args = p.parse_args(argv)
    run_entry_point(lambda: convert(args))


if __name__ == "__main__":
    main()
