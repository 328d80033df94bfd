"""Convert a checkpoint of this trainer to a Hugging Face LlamaForCausalLM directory.

    python tools/checkpoint/convert_to_hf.py --load CKPT [--iteration N] --save HF_DIR [--tokenizer-model TOK]
"""

import argparse

import torch

from megatron_lc.models.llama.conversion import checkpoint_to_hf


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="--save directory of a run, or one iter_* checkpoint")
    p.add_argument("--iteration", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--save", required=True, help="output directory (safetensors + config.json)")
    p.add_argument("--tokenizer-model", default=None, help="tokenizer to ship with the weights")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = p.parse_args(argv)
    out = checkpoint_to_hf(args.load, args.save, args.iteration, getattr(torch, args.dtype), args.tokenizer_model)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
