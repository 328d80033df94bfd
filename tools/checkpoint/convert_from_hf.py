"""Convert a Hugging Face LlamaForCausalLM directory to a checkpoint this trainer loads with --load.

    python tools/checkpoint/convert_from_hf.py --load HF_DIR --save CKPT [--force]

The result is weights-only: training from it starts at step 0 (continued pretraining). A config
field the model does not compute exactly is refused in one line (exit status 2), as is a --save
that already holds checkpoints unless --force.
"""

import os

from megatron_lc.errors import ConfigError
from megatron_lc.command_line import ArgumentParser
from megatron_lc.entry import run_entry_point
from megatron_lc.training.hf_conversion import hf_to_checkpoint
from megatron_lc.models.llama.hf import UnsupportedHFConfig


def check_hf_directory(load: str) -> None:
    """A local directory with a config.json: anything else would be read by transformers as a Hub repo id and
    refused as a badly formed one."""
    if not os.path.isdir(load):
        raise ConfigError(f"--load {load}: no such directory (a local Hugging Face model directory; download a Hub "
                          "model first, e.g. huggingface-cli download REPO --local-dir DIR)")
    if not os.path.isfile(os.path.join(load, "config.json")):
        raise ConfigError(f"--load {load}: no config.json there (not a Hugging Face model directory)")


def convert(argv) -> None:
    args = build_parser().parse_args(argv)
    check_hf_directory(args.load)
    try:
        print(f"wrote {hf_to_checkpoint(args.load, args.save, force=args.force)}")
    except UnsupportedHFConfig as e:
        raise ConfigError(f"--load {args.load}: {e}") from e
    except FileNotFoundError as e:  # no safetensors files: named by the conversion
        raise ConfigError(str(e)) from e


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="convert_from_hf.py", description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="Hugging Face model directory")
    p.add_argument("--save", required=True, help="checkpoint root to write (empty, or new)")
    p.add_argument("--force", action="store_true", help="add iter_0000000 to a --save that holds checkpoints; "
                   "the marker keeps naming their latest step")
    return p


def main(argv=None) -> None:
    run_entry_point(lambda: convert(argv))


if __name__ == "__main__":
    main()
