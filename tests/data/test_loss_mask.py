"""loss_mask.py: masks merged with their datasets, masked and unmasked never mixed, masks that do not fit their ids
named; merge_datasets.py carries them."""

from __future__ import annotations

import os

import numpy as np
import pytest

from megatron_lc.data.indexed_dataset import IndexedDataset, write_dataset
from megatron_lc.data.loss_mask import (
    has_loss_mask,
    loss_mask_mismatch,
    loss_mask_prefix,
    merge_with_loss_masks,
)
from megatron_lc.data.merge_tool import main as merge_main


def write_masked(prefix, documents, seed: int) -> list[np.ndarray]:
    """`documents` with a random 0/1 mask each; the masks."""
    rng = np.random.default_rng(seed)
    masks = [rng.integers(0, 2, size=len(d)).astype(np.uint8) for d in documents]
    write_dataset(prefix, documents, dtype=np.uint16)
    write_dataset(loss_mask_prefix(prefix), masks, dtype=np.uint8)
    return masks


def contents(prefix) -> list[list[int]]:
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


def test_masked_datasets_merge_with_their_masks_in_order(tmp_path, random_documents):
    a, b = random_documents(1, 9, 50), random_documents(2, 5, 50)
    masks = write_masked(tmp_path / "a", a, 1) + write_masked(tmp_path / "b", b, 2)
    assert merge_with_loss_masks([tmp_path / "a", tmp_path / "b"], tmp_path / "m") is True
    assert contents(tmp_path / "m") == [d.tolist() for d in a + b]
    assert contents(loss_mask_prefix(tmp_path / "m")) == [m.tolist() for m in masks]
    assert loss_mask_mismatch(tmp_path / "m") == ""


def test_unmasked_datasets_merge_without_a_mask_and_drop_an_old_one(tmp_path, random_documents):
    write_masked(tmp_path / "m", random_documents(3, 4, 20), 3)  # an earlier masked output at the same prefix
    for name, seed in (("a", 4), ("b", 5)):
        write_dataset(tmp_path / name, random_documents(seed, 4, 20), dtype=np.uint16)
    assert merge_with_loss_masks([tmp_path / "a", tmp_path / "b"], tmp_path / "m") is False
    assert not has_loss_mask(tmp_path / "m") and not os.path.exists(loss_mask_prefix(tmp_path / "m") + ".bin")


def test_masked_and_unmasked_are_refused_before_anything_is_written(tmp_path, random_documents, capsys):
    write_masked(tmp_path / "a", random_documents(1, 4, 20), 1)
    write_dataset(tmp_path / "b", random_documents(2, 4, 20), dtype=np.uint16)
    with pytest.raises(ValueError, match=f"^{tmp_path / 'a'} carries a loss mask .* and {tmp_path / 'b'} does not"):
        merge_with_loss_masks([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    assert sorted(os.listdir(tmp_path)) == sorted(["a.bin", "a.idx", "a_loss_mask.bin", "a_loss_mask.idx",
                                                   "b.bin", "b.idx"])
    assert merge_main(["--input", str(tmp_path / "a"), str(tmp_path / "b"), "--output-prefix", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("merge_datasets: error: ") and "carries a loss mask" in err and "\n" not in err


def test_a_mask_that_does_not_fit_its_ids_is_named(tmp_path, random_documents):
    documents = random_documents(1, 4, 20)
    write_dataset(tmp_path / "a", documents, dtype=np.uint16)
    write_dataset(loss_mask_prefix(tmp_path / "a"), [np.ones(len(d) + 1, np.uint8) for d in documents], dtype=np.uint8)
    assert "differ from" in loss_mask_mismatch(tmp_path / "a")
    with pytest.raises(ValueError, match="a_loss_mask.idx: its sequence lengths or document indices differ"):
        merge_with_loss_masks([tmp_path / "a"], tmp_path / "m")


def test_merge_tool_carries_masks_and_a_directory_input_skips_mask_files(tmp_path, random_documents, capsys):
    parts = tmp_path / "parts"
    parts.mkdir()
    a, b = random_documents(1, 6, 30), random_documents(2, 6, 30)
    masks = write_masked(parts / "a", a, 1) + write_masked(parts / "b", b, 2)
    assert merge_main(["--input", str(parts), "--output-prefix", str(tmp_path / "all")]) == 0
    assert "and their loss masks into" in capsys.readouterr().out
    assert contents(tmp_path / "all") == [d.tolist() for d in a + b]
    assert contents(loss_mask_prefix(tmp_path / "all")) == [m.tolist() for m in masks]
