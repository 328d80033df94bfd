"""Where a dataset's per-token loss mask lives, and what it means.

Fine-tuning data carries a loss mask beside its token ids. The ids stay exactly
Megatron's indexed dataset (`PREFIX.bin` / `PREFIX.idx`, readable by Megatron-LM
unchanged); the mask is a second indexed dataset at `PREFIX_loss_mask` with the
same sequence lengths and document indices, dtype uint8: `mask[t] == 1` when token
`t` is trained on as a target (the label of the position before it), 0 when not.
A dataset without the mask files trains on every token, as plain text always has.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from megatron_lc.data.document_locations import concatenate_locations, remove_locations
from megatron_lc.data.indexed_dataset import IndexedDataset, PathLike, bin_path, idx_path, merge_datasets

LOSS_MASK_SUFFIX = "_loss_mask"
LOSS_MASK_DTYPE = np.uint8


def loss_mask_prefix(path_prefix: PathLike) -> str:
    """The prefix of the loss mask that belongs to the dataset at `path_prefix`."""
    return os.fspath(path_prefix) + LOSS_MASK_SUFFIX


def has_loss_mask(path_prefix: PathLike) -> bool:
    """Whether the dataset at `path_prefix` carries a loss mask."""
    return IndexedDataset.exists(loss_mask_prefix(path_prefix))


def loss_mask_mismatch(path_prefix: PathLike) -> str:
    """Why the loss mask of the dataset at `path_prefix` does not fit its ids ('' when it does): another dtype,
    other sequence lengths or other document indices."""
    ids, mask = IndexedDataset(path_prefix), IndexedDataset(loss_mask_prefix(path_prefix))
    if mask.dtype != LOSS_MASK_DTYPE:
        return f"{mask.index.path}: dtype {mask.dtype}, a loss mask is {np.dtype(LOSS_MASK_DTYPE)}"
    if not (np.array_equal(mask.sequence_lengths, ids.sequence_lengths)
            and np.array_equal(mask.document_indices, ids.document_indices)):
        return f"{mask.index.path}: its sequence lengths or document indices differ from {ids.index.path}'s"
    return ""


def remove_dataset_files(path_prefix: PathLike) -> None:
    """Remove a dataset's files, `.idx` first (a `.bin` without its index is no dataset)."""
    for path in (idx_path(path_prefix), bin_path(path_prefix)):
        if os.path.exists(path):
            os.remove(path)


def merge_with_loss_masks(input_prefixes: Sequence[PathLike], output_prefix: PathLike) -> bool:
    """Concatenate datasets into `output_prefix`, their loss masks with them when they all carry one; whether a
    mask was written. Datasets with and without a mask are not merged (a `ValueError` naming one of each): a
    missing mask means every token is trained on, which fine-tuning data mixed in would silently change. The
    output's old index goes first and its mask is in place before its ids, so a dataset that reads back whole
    never pairs new ids with an old mask or none."""
    masked = [os.fspath(prefix) for prefix in input_prefixes if has_loss_mask(prefix)]
    unmasked = [os.fspath(prefix) for prefix in input_prefixes if not has_loss_mask(prefix)]
    if masked and unmasked:
        raise ValueError(f"{masked[0]} carries a loss mask ({loss_mask_prefix(masked[0])}) and {unmasked[0]} does "
                         "not: merge datasets with masks only with datasets with masks (a dataset without one trains "
                         "on every token: preprocess it with --chat-template, or keep the two apart in a blend)")
    for prefix in masked:
        mismatch = loss_mask_mismatch(prefix)
        if mismatch:
            raise ValueError(mismatch)
    if os.path.exists(idx_path(output_prefix)):
        os.remove(idx_path(output_prefix))
    if masked:
        merge_datasets([loss_mask_prefix(prefix) for prefix in masked], loss_mask_prefix(output_prefix))
    else:
        remove_dataset_files(loss_mask_prefix(output_prefix))
    remove_locations(output_prefix)
    merge_datasets(input_prefixes, output_prefix)
    concatenate_locations(input_prefixes, output_prefix)
    return bool(masked)


def open_loss_mask(ids: IndexedDataset) -> IndexedDataset | None:
    """The loss mask of the dataset `ids`, checked against it (same sequence lengths and document indices,
    uint8), or None when it has none. A mask that does not match its ids is refused in one line."""
    prefix = loss_mask_prefix(ids.path_prefix)
    if not IndexedDataset.exists(prefix):
        return None
    mismatch = loss_mask_mismatch(ids.path_prefix)
    if mismatch:
        raise ValueError(f"{mismatch}: rewrite both with the same preprocessing run")
    return IndexedDataset(prefix)
