"""The passkey test: does the model read its whole context? (`python -m megatron_lc.evaluate --passkey`)

A random five-digit key is hidden at a chosen depth of `seq_length` tokens of repeated filler text
("The grass is green. The sky is blue. ..."), and the sample ends with the question and its answer:
`... The pass key is 71432. Remember it. 71432 is the pass key. ... What is the pass key? The pass key
is 71432`. The answer's tokens are scored teacher-forced: a key counts as retrieved when every one of
its tokens has probability above one half (so each is the model's first choice); the mean loss on them
is reported too. One row per depth, over `trials` keys each, the same keys at every depth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron_lc.data.tokenizers import Tokenizer
from megatron_lc.errors import ConfigError
from megatron_lc.parallel_state import ParallelState

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class PasskeySample:
    """One sample: `seq_length + 1` token ids, and the label positions of the answer (the key's tokens)."""

    ids: np.ndarray
    answer: np.ndarray


def passkey_sample(tokenizer: Tokenizer, seq_length: int, depth: float, key: str) -> PasskeySample:
    """The key's needle at `depth` (0: right at the start, 1: just before the question) of the filler."""
    needle = tokenizer.tokenize(f" The pass key is {key}. Remember it. {key} is the pass key. ")
    question = tokenizer.tokenize(" What is the pass key? The pass key is")
    answer = tokenizer.tokenize(f" {key}")
    budget = seq_length + 1 - len(needle) - len(question) - len(answer)
    if budget < 0:
        raise ConfigError(f"--seq-length {seq_length}: the passkey's needle, question and answer alone take "
                          f"{seq_length + 1 - budget} tokens; give a longer --seq-length")
    unit = tokenizer.tokenize(FILLER)
    filler = (unit * (budget // max(len(unit), 1) + 1))[:budget]
    before = round(depth * budget)
    ids = np.array(filler[:before] + needle + filler[before:] + question + answer, dtype=np.int64)
    first = seq_length + 1 - len(answer)  # the answer's first token, predicted at label position first - 1
    return PasskeySample(ids, np.arange(first - 1, seq_length))


def passkey_keys(trials: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [str(k) for k in rng.integers(10_000, 100_000, size=trials)]


def run_passkey(model, tokenizer: Tokenizer, pstate: ParallelState, device: torch.device, seq_length: int,
                depths=DEFAULT_DEPTHS, trials: int = 5, seed: int = 0) -> dict:
    """The retrieval rate and the answer's mean loss at each depth; every context-parallel rank runs its slice."""
    ranges = pstate.context_layout.token_ranges(seq_length, pstate.cp_rank)
    local = np.concatenate([np.arange(a, b) for a, b in ranges])
    rows = []
    for depth in depths:
        retrieved, loss_sum, answer_tokens = 0, 0.0, 0
        for key in passkey_keys(trials, seed):
            sample = passkey_sample(tokenizer, seq_length, depth, key)
            inputs = torch.as_tensor(sample.ids[local], device=device).unsqueeze(0)
            labels = torch.as_tensor(sample.ids[local + 1], device=device).unsqueeze(0)
            positions = torch.as_tensor(local, device=device).unsqueeze(0)
            with torch.no_grad():
                losses = model(inputs, positions, labels, (0, seq_length), per_token=True)[0].double()
            is_answer = torch.as_tensor(np.isin(local, sample.answer), device=device)
            totals = torch.stack([(losses * is_answer).sum(), ((losses < math.log(2)) & is_answer).sum().double()])
            if pstate.cp_size > 1:
                dist.all_reduce(totals, group=pstate.cp_group)
            loss, confident = totals.tolist()
            retrieved += int(confident == len(sample.answer))
            loss_sum, answer_tokens = loss_sum + loss, answer_tokens + len(sample.answer)
        rows.append({"depth": depth, "retrieved": retrieved / trials, "answer_loss": loss_sum / answer_tokens})
    return {"seq_length": seq_length, "trials": trials, "passkey": rows}
