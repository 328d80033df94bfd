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

import numpy as np

from megatron_lc.data.indexed_dataset import IndexedDataset, PathLike

LOSS_MASK_SUFFIX = "_loss_mask"
LOSS_MASK_DTYPE = np.uint8


def loss_mask_prefix(path_prefix: PathLike) -> str:
    """The prefix of the loss mask that belongs to the dataset at `path_prefix`."""
    return os.fspath(path_prefix) + LOSS_MASK_SUFFIX


def has_loss_mask(path_prefix: PathLike) -> bool:
    """Whether the dataset at `path_prefix` carries a loss mask."""
    return IndexedDataset.exists(loss_mask_prefix(path_prefix))


def open_loss_mask(ids: IndexedDataset) -> IndexedDataset | None:
    """The loss mask of the dataset `ids`, checked against it (same sequence lengths and document indices,
    uint8), or None when it has none. A mask that does not match its ids is refused in one line."""
    prefix = loss_mask_prefix(ids.path_prefix)
    if not IndexedDataset.exists(prefix):
        return None
    mask = IndexedDataset(prefix)
    if mask.dtype != LOSS_MASK_DTYPE:
        raise ValueError(f"{prefix}: a loss mask is uint8, this one is {mask.dtype}")
    if (not np.array_equal(mask.sequence_lengths, ids.sequence_lengths)
            or not np.array_equal(mask.document_indices, ids.document_indices)):
        raise ValueError(f"{prefix}: the loss mask's sequence lengths or document indices differ from "
                         f"{ids.path_prefix}'s: rewrite both with the same preprocessing run")
    return mask
