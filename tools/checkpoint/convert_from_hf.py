"""Convert a Hugging Face LlamaForCausalLM directory to a checkpoint this trainer loads with --load.

    python tools/checkpoint/convert_from_hf.py --load HF_DIR --save CKPT

The result is weights-only: training from it starts at step 0 (continued pretraining).
"""

import argparse

from megatron_lc.models.llama.conversion import hf_to_checkpoint


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="Hugging Face model directory")
    p.add_argument("--save", required=True, help="checkpoint root to write")
    args = p.parse_args(argv)
    print(f"wrote {hf_to_checkpoint(args.load, args.save)}")


if __name__ == "__main__":
    main()
