"""Convert a checkpoint of this trainer to a Hugging Face LlamaForCausalLM directory.

    python tools/checkpoint/convert_to_hf.py --load CKPT [--iteration N] --save HF_DIR [--tokenizer-model TOK]

Streams tensor by tensor into safetensors shards of at most --max-shard-size (with
model.safetensors.index.json when there are several): host memory is about one shard.
"""

import argparse
import json

import torch

from megatron_lc.errors import ConfigError
from megatron_lc.command_line import ArgumentParser
from megatron_lc.data.tokenizers import TOKENIZER_TYPES
from megatron_lc.entry import run_entry_point
from megatron_lc.training.hf_conversion import checkpoint_to_hf


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes (also KB, MB, and a plain number of bytes)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    unit = next((u for u in units if text.upper().endswith(u)), None)
    try:
        return int(float(text[:-2]) * units[unit]) if unit else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 5GB or 500MB") from None


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="convert_to_hf.py", description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="--save directory of a run, or one iter_* checkpoint")
    p.add_argument("--iteration", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--save", required=True, help="output directory (safetensors + config.json)")
    p.add_argument("--tokenizer-model", default=None, help="tokenizer to ship with the weights (default: the one "
                   "the checkpoint was trained with); its bos/eos/pad ids go into the configs")
    p.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                   help="type of --tokenizer-model (default: a directory or .json is HuggingFaceTokenizer, a "
                   "SentencePiece model SentencePieceTokenizer, else TikTokenizer)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                   help="weights' precision (default: the checkpoint's training precision: bfloat16 for a --bf16 "
                   "run, float32 otherwise)")
    p.add_argument("--max-shard-size", type=parse_size, default="5GB",
                   help="largest safetensors shard, e.g. 5GB or 500MB (default 5GB, as transformers)")
    return p


def convert(argv) -> None:
    args = build_parser().parse_args(argv)
    try:
        dtype = getattr(torch, args.dtype) if args.dtype else None
        out = checkpoint_to_hf(args.load, args.save, args.iteration, dtype, args.tokenizer_model,
                               max_shard_bytes=args.max_shard_size, tokenizer_type=args.tokenizer_type)
    except FileNotFoundError as e:  # no checkpoint in --load, no --tokenizer-model: named by the conversion
        raise ConfigError(str(e)) from e
    config = json.loads((out / "config.json").read_text())
    written = config.get("torch_dtype") or config.get("dtype")  # transformers' key, by its version
    print(f"wrote {out} ({written}{'' if args.dtype else ', the checkpoint training precision; --dtype to change'})")


def main(argv=None) -> None:
    run_entry_point(lambda: convert(argv))


if __name__ == "__main__":
    main()
