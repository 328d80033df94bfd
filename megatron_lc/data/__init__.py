"""Data: Megatron indexed datasets, tokenizers, preprocessing, long-sequence samples, loaders.

`MicroBatchLoader` and `Batch` (the only parts that need torch) load on first use, so
preprocessing and its worker processes start without importing torch.
"""

from megatron_lc.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    IndexReader,
    IndexWriter,
    merge_datasets,
    optimal_dtype,
    write_dataset,
)
from megatron_lc.data.samples import LongSequenceSamples, MockSamples, Sample
from megatron_lc.data.tokenizers import TOKENIZER_TYPES, Tokenizer, build_tokenizer

__all__ = [
    "Batch",
    "IndexReader",
    "IndexWriter",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "LongSequenceSamples",
    "MicroBatchLoader",
    "MockSamples",
    "Sample",
    "TOKENIZER_TYPES",
    "Tokenizer",
    "build_tokenizer",
    "merge_datasets",
    "optimal_dtype",
    "write_dataset",
]


def __getattr__(name: str):
    if name in ("Batch", "MicroBatchLoader"):
        from megatron_lc.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
