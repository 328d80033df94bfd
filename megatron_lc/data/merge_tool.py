"""Concatenate indexed datasets (same dtype) into one, in the order given.

Example:
    python tools/merge_datasets.py --input data/part0_text_document data/part1_text_document \
        --output-prefix data/all_text_document

A directory given as input stands for every dataset (`*.idx`) in it, sorted by name (a loss mask, `*_loss_mask`,
stands with its dataset, not as one of its own).

Loss masks (`megatron_lc.data.loss_mask`) are carried: when every input has one, the output has the masks merged
in the same order. Inputs with and without a mask are refused in one line, as a dataset without a mask trains on
every token: keep such datasets apart (a blend of two prefixes) or preprocess the plain one with a template.
"""

import argparse
import os
import sys

from megatron_lc.command_line import ArgumentParser, check_writable, run_tool
from megatron_lc.errors import ConfigError
from megatron_lc.data.indexed_dataset import IndexedDatasetError, idx_path
from megatron_lc.data.loss_mask import LOSS_MASK_SUFFIX, merge_with_loss_masks


def expand_prefixes(inputs: list[str]) -> list[str]:
    """Dataset prefixes; a directory stands for the datasets it holds."""
    prefixes = []
    for path in inputs:
        if os.path.isdir(path):
            names = sorted(name[: -len(".idx")] for name in os.listdir(path)
                           if name.endswith(".idx") and not name.endswith(LOSS_MASK_SUFFIX + ".idx"))
            if not names:
                raise ConfigError(f"--input {path}: directory holds no .idx file")
            prefixes.extend(os.path.join(path, name) for name in names)
        else:
            prefixes.append(path[: -len(".idx")] if path.endswith((".idx", ".bin")) else path)
    for prefix in prefixes:  # a damaged pair is the reader's to name
        if not os.path.isfile(idx_path(prefix)):
            raise ConfigError(f"--input {prefix}: no {idx_path(prefix)}")
    return prefixes


def main(argv: list[str] | None = None) -> int:
    """0 when merged; one line and 2 for a command line that cannot work, 1 for a bad dataset file."""
    return run_tool("merge_datasets", merge, argv)


def merge(argv: list[str] | None) -> int:
    parser = ArgumentParser(prog="merge_datasets.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="dataset prefixes (or directories of datasets)")
    parser.add_argument("--output-prefix", required=True,
                        help="writes OUTPUT_PREFIX.{bin,idx} (and OUTPUT_PREFIX_loss_mask.{bin,idx} for masked inputs)")
    args = parser.parse_args(argv)
    prefixes = expand_prefixes(args.input)
    check_writable(os.path.dirname(os.path.abspath(args.output_prefix)), "--output-prefix")
    try:
        masked = merge_with_loss_masks(prefixes, args.output_prefix)
    except (IndexedDatasetError, ValueError) as error:
        print(f"merge_datasets: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # a full disk: the path and the OS's reason
        print(f"merge_datasets: error: {error.filename or args.output_prefix}: {error.strerror or error}",
              file=sys.stderr)
        return 1
    masks = f" and their loss masks into {args.output_prefix}{LOSS_MASK_SUFFIX}.bin/.idx" if masked else ""
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}.bin/.idx{masks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
