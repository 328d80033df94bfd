"""Loss of a checkpoint on a dataset, in stream order: `python -m megatron_lc.evaluate`.

    python -m megatron_lc.evaluate --load CKPT --data-path [W1] PREFIX1 [[W2] PREFIX2 ...] --seq-length S \
        [--split 969,30,1 [--split-part valid]] [--num-samples N] [--context-parallel-size CP] \
        [--loss-by-position BUCKETS]
    python -m megatron_lc.evaluate --load CKPT --passkey --seq-length S [--passkey-depths 0 0.5 1]

--data-path takes training's blend syntax (weights or none, blended as megatron-core blends
them); with --split, one part of it (the validation part unless --split-part says otherwise).

Prints one JSON object: samples, tokens, loss (mean per valid token) and, with
--loss-by-position, the mean loss in each of BUCKETS equal ranges of the position a token has in
the context its prediction sees (its document with --reset-attention-mask, else its sample): the
long-context curve, does loss keep falling deep into the context? A bucket no token reaches has
loss null. --reset-attention-mask and --reset-position-ids default to the training's (recorded in
the checkpoint), so the evaluation sees the contexts training saw.
Runs under torchrun like training (dp ranks split the samples, cp ranks the sequence).
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_lc.command_line import ArgumentParser
from megatron_lc.arguments import add_section_flag
from megatron_lc.data.sources import SPLIT_NAMES
from megatron_lc.entry import run_entry_point
from megatron_lc.evaluation.checkpoint_evaluation import evaluate
from megatron_lc.parallel_state import detect_launch

def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m megatron_lc.evaluate", description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="checkpoint directory (a --save root or one iter_* directory)")
    # training's flags, from the sections that declare them (megatron_lc.arguments)
    add_section_flag(p, "data_path", help="indexed dataset prefixes, as for training: PREFIX ... or W1 PREFIX1 W2 "
                                          "PREFIX2 ... (required unless --passkey)")
    add_section_flag(p, "split", help="train,valid,test weights as for training (default: every document)")
    p.add_argument("--split-part", default="valid", choices=SPLIT_NAMES, help="with --split: the part evaluated")
    add_section_flag(p, "seq_length", required=True, help="tokens per sample")
    p.add_argument("--num-samples", type=int, default=None, help="samples to evaluate (default: all whole samples)")
    add_section_flag(p, "micro_batch_size")
    p.add_argument("--reset-position-ids", action=argparse.BooleanOptionalAction, default=None,
                   help="restart positions at each document (default: as the checkpoint's training)")
    p.add_argument("--reset-attention-mask", action=argparse.BooleanOptionalAction, default=None,
                   help="attend within each document only (default: as the checkpoint's training; Megatron-LM's "
                        "default attends across end-of-document tokens)")
    add_section_flag(p, "packing", default=None,
                     help="how samples are cut, as for megatron_lc.train (default: as the checkpoint was trained)")
    add_section_flag(p, "long_documents", default=None,
                     help="--packing documents: documents longer than --seq-length stop, are truncated or dropped "
                          "(default: as the checkpoint was trained)")
    for name in ("context_parallel_size", "data_parallel_replicate", "cp_impl", "cp_comm_type",
                 "hierarchical_context_parallel_sizes"):
        add_section_flag(p, name)
    p.add_argument("--loss-by-position-in", default=None, choices=("context", "sample"),
                   help="with --loss-by-position: bucket a token by its position in the context its prediction sees "
                        "(its document with --reset-attention-mask, else its sample; the default) or in its sample")
    p.add_argument("--loss-by-position", type=int, default=None, metavar="BUCKETS",
                   help="also report the mean loss in BUCKETS equal position ranges")
    p.add_argument("--passkey", action="store_true",
                   help="instead of a dataset's loss, the passkey test: a key hidden at each --passkey-depths of "
                        "each --passkey-lengths tokens (the --data-path documents as haystack, else filler text), "
                        "retrieved by greedy decoding or not (megatron_lc/evaluation/passkey.py)")
    p.add_argument("--passkey-depths", type=float, nargs="+", default=None,
                   help="with --passkey: where the key sits, 0 (the start) to 1 (just before the question)")
    p.add_argument("--passkey-trials", type=int, default=None, help="with --passkey: keys per depth (default 5)")
    p.add_argument("--passkey-lengths", type=int, nargs="+", default=None,
                   help="with --passkey: the context lengths tested (default: --seq-length)")
    p.add_argument("--passkey-plot", default=None, metavar="FILE.png",
                   help="with --passkey: draw the depth x length retrieval map")
    add_section_flag(p, "tokenizer_type", help="with --passkey: the tokenizer (default: the checkpoint's training's)")
    add_section_flag(p, "tokenizer_model", help="with --passkey: its file (default: the training's)")
    add_section_flag(p, "device")
    return p


def main(argv=None) -> None:
    def evaluate_and_print() -> None:
        result = evaluate(build_parser().parse_args(argv))  # a usage error is one line too
        if detect_launch().rank == 0:
            print(json.dumps(result), flush=True)

    run_entry_point(evaluate_and_print)


if __name__ == "__main__":
    main(sys.argv[1:])
