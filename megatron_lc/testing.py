"""What the tests and the benchmarks share: multi-process gloo runs on free ports, and reference batches of
packed documents with their per-rank shards (the exactness tests compare every parallel layout on them)."""

from __future__ import annotations

import itertools
import json
import os
import random
import socket
import tempfile
from typing import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_lc.context_layout import ContextLayout
from megatron_lc.entry import exit_process


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


_port_draws = itertools.count(random.SystemRandom().randrange(1000))


def free_port() -> int:
    """A free port for a rendezvous, below the ephemeral range (no connection of another test's processes can
    take it before the rendezvous binds it) and, under pytest-xdist, in this worker's own share of the ports."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = 10000
    span = max(1000, (_ephemeral_low() - low) // max(workers, 1))
    for _ in range(span):
        port = low + index * span + next(_port_draws) % span
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (or waiting to close): the next one
            return port
    raise RuntimeError(f"no free port in {low + index * span}-{low + (index + 1) * span}")


def _worker(rank, fn, world_size, port, args):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    fn(rank, world_size, *args)  # a failure propagates: mp.spawn reports its traceback and fails the test
    dist.destroy_process_group()
    exit_process(0)  # as the entry points do: the interpreter's teardown can abort on gloo's threads


def run_distributed(fn, world_size: int, *args) -> None:
    """Run fn(rank, world_size, *args) in `world_size` gloo processes; a failure in any fails the test."""
    mp.spawn(_worker, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)


def _rank_zero_writes(rank, world_size, fn, out_path, *args):
    result = fn(rank, world_size, *args)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


def rank_zero_result(fn, world_size: int, *args):
    """`run_distributed(fn, world_size, *args)`, returning what fn returned on rank 0 (JSON: it comes back through
    a file)."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.json")
        run_distributed(_rank_zero_writes, world_size, fn, out_path, *args)
        with open(out_path) as f:
            return json.load(f)


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: tuple


def make_batch(num_samples: int, seq_length: int, vocab: int, *, seed: int = 0, num_docs: int = 3,
               ignore_fraction: float = 0.0, masked_spans: bool = False,
               documents: list[list[int]] | None = None) -> tuple[Batch, list[tuple]]:
    """Random tokens with packed documents of uneven lengths and unevenly ignored labels.

    `documents`: each sample's document lengths (summing to `seq_length`) instead of `num_docs` at random.

    `masked_spans`: targets ignored as a chat loss mask ignores them, in spans (the prompts), a different
    share in each sample, and sample 1 ignored whole (a micro-batch or rank with no loss token).

    Returns the full batch and each sample's own cu_seqlens (needed to re-flatten a subset).
    """
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (num_samples, seq_length + 1), generator=g)
    labels = tokens[:, 1:].clone()
    if ignore_fraction:  # ignore a prefix of the first sample only: ranks hold different valid counts
        labels[0, : int(seq_length * ignore_fraction)] = -100
    if masked_spans:
        for b in range(num_samples):
            edges = sorted(torch.randperm(seq_length - 1, generator=g)[: 2 * (b % 3 + 1)].add(1).tolist())
            for start, stop in zip(edges[::2], edges[1::2]):
                labels[b, start:stop] = -100
        if num_samples > 1:
            labels[1] = -100
    per_sample = []
    for b in range(num_samples):
        if documents is not None:
            if sum(documents[b]) != seq_length:
                raise ValueError(f"sample {b}'s documents {documents[b]} do not sum to {seq_length}")
            per_sample.append(tuple(itertools.accumulate(documents[b], initial=0)))
            continue
        cuts = sorted(torch.randperm(seq_length - 1, generator=g)[: num_docs - 1].add(1).tolist())
        per_sample.append((0, *cuts, seq_length))
    positions = torch.arange(seq_length).expand(num_samples, seq_length)
    return Batch(tokens[:, :-1], labels, positions, flatten_cu_seqlens(per_sample, seq_length)), per_sample


def flatten_cu_seqlens(per_sample: list[tuple], seq_length: int) -> tuple:
    out = [0]
    for b, cu in enumerate(per_sample):
        out += [b * seq_length + c for c in cu[1:]]
    return tuple(out)


def shard_batch(batch: Batch, per_sample, dp_rank: int, dp: int, cp_rank: int, cp: int,
                layout: ContextLayout | None = None) -> Batch:
    """This rank's samples (by dp rank) and tokens (by cp rank and `layout`, default
    all-to-all only); boundaries stay global."""
    B = batch.input_ids.shape[0] // dp
    S = batch.input_ids.shape[1]
    rows = slice(dp_rank * B, (dp_rank + 1) * B)
    layout = layout or ContextLayout(a2a_size=cp)
    assert layout.cp_size == cp
    samples = range(dp_rank * B, (dp_rank + 1) * B)
    cols = torch.stack([torch.tensor([p for a, b in layout.token_ranges(S, cp_rank, per_sample[s]) for p in range(a, b)])
                        for s in samples])
    picked = torch.tensor(list(samples)).unsqueeze(1)
    return Batch(batch.input_ids[picked, cols], batch.labels[picked, cols], batch.position_ids[picked, cols],
                 flatten_cu_seqlens(per_sample[rows], S))


# Llama 3 Instruct's chat template, as its tokenizer_config.json ships it.
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_CHAT_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>")


def write_chat_tokenizer(directory: str | os.PathLike, texts: list[str], vocab_size: int = 600) -> str:
    """A Llama-3-like tokenizer directory made on the spot (nothing downloaded): a byte-level BPE trained on
    `texts` with Llama 3's pre-tokenizer and chat specials, and Llama 3 Instruct's chat template in its
    tokenizer_config.json, as transformers' AutoTokenizer loads it."""
    from megatron_lc.data.tokenizers import LLAMA3_PATTERN

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|eot_id|>", "chat_template": LLAMA3_CHAT_TEMPLATE}
    return write_bytelevel_tokenizer(directory, texts, LLAMA3_PATTERN, LLAMA3_CHAT_SPECIALS, config, vocab_size)


def write_bytelevel_tokenizer(directory: str | os.PathLike, texts: list[str], pattern: str, specials: Sequence[str],
                              config: dict, vocab_size: int, added: Sequence[str] = ()) -> str:
    """A byte-level BPE tokenizer directory trained on `texts`, split first by the regex `pattern`, with `specials`
    (special tokens) and `added` (plain added tokens, as Qwen's <think>), and `config` as its
    tokenizer_config.json."""
    import json

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in added])
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as stream:
        json.dump(config, stream, indent=1)
    return os.fspath(directory)
