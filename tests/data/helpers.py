"""Helpers of the data tests: the byte tokenizer's ids of a text, and what preprocessing wrote."""

from __future__ import annotations

from megatron_lc.data.indexed_dataset import IndexedDataset
from megatron_lc.data.tokenizers import ByteTokenizer

EOD = ByteTokenizer.EOD_ID


def byte_tokens(text: str, eod: bool = True) -> list[int]:
    return list(text.encode("utf-8")) + ([EOD] if eod else [])


def read_documents(prefix: str, key: str = "text") -> list[list[int]]:
    dataset = IndexedDataset(f"{prefix}_{key}_document")
    return [dataset[i].tolist() for i in range(len(dataset))]


def output_bytes(prefix: str, key: str = "text") -> tuple[bytes, bytes]:
    base = f"{prefix}_{key}_document"
    return open(base + ".bin", "rb").read(), open(base + ".idx", "rb").read()


def reference_chat_ids(tokenizer, messages, **kwargs) -> list[int]:
    """`tokenizer.apply_chat_template(messages, **kwargs)`'s ids (transformers 5 returns a BatchEncoding, 4 a
    list)."""
    out = tokenizer.apply_chat_template(messages, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)
