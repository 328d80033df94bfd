"""The passkey test: does the model read its whole context? (`python -m megatron_lc.evaluate --passkey`)

A random five-digit key is hidden at a chosen depth of a haystack of `seq_length` tokens (the evaluation
data's documents in stream order with `--data-path`, else repeated filler text "The grass is green. The
sky is blue. ..."), and the sample ends with the question and its answer: `... The pass key is 71432.
Remember it. 71432 is the pass key. ... What is the pass key? The pass key is 71432`. The answer is
scored exactly, teacher-forced: a key is retrieved when greedy decoding would write each of its tokens
(every one is its position's argmax); the answer's mean loss is reported too. One row per length and
depth, over `trials` keys, the same keys everywhere; a table, and a depth x length PNG.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron_lc.data.tokenizers import Tokenizer
from megatron_lc.errors import ConfigError
from megatron_lc.parallel_state import ParallelState

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
Haystack = Callable[[int], np.ndarray]
"""n -> the first n haystack token ids."""


@dataclass(frozen=True)
class PasskeySample:
    """One sample: `seq_length + 1` token ids, and the label positions of the answer (the key's tokens)."""

    ids: np.ndarray
    answer: np.ndarray


def filler_haystack(tokenizer: Tokenizer) -> Haystack:
    unit = tokenizer.tokenize(FILLER)
    return lambda n: np.array((unit * (n // max(len(unit), 1) + 1))[:n], dtype=np.int64)


def passkey_sample(tokenizer: Tokenizer, seq_length: int, depth: float, key: str,
                   haystack: Haystack | None = None) -> PasskeySample:
    """The key's needle at `depth` (0: right at the start, 1: just before the question) of the haystack."""
    needle = tokenizer.tokenize(f" The pass key is {key}. Remember it. {key} is the pass key. ")
    question = tokenizer.tokenize(" What is the pass key? The pass key is")
    answer = tokenizer.tokenize(f" {key}")
    budget = seq_length + 1 - len(needle) - len(question) - len(answer)
    if budget < 0:
        raise ConfigError(f"--seq-length {seq_length}: the passkey's needle, question and answer alone take "
                          f"{seq_length + 1 - budget} tokens; give a longer --seq-length")
    hay = (haystack or filler_haystack(tokenizer))(budget)
    before = round(depth * budget)
    ids = np.concatenate([hay[:before], needle, hay[before:], question, answer]).astype(np.int64)
    first = seq_length + 1 - len(answer)  # the answer's first token, predicted at label position first - 1
    return PasskeySample(ids, np.arange(first - 1, seq_length))


def passkey_keys(trials: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [str(k) for k in rng.integers(10_000, 100_000, size=trials)]


def run_passkey(model, tokenizer: Tokenizer, pstate: ParallelState, device: torch.device, lengths,
                depths=DEFAULT_DEPTHS, trials: int = 5, seed: int = 0, haystack: Haystack | None = None) -> dict:
    """The retrieval rate and the answer's mean loss at each length and depth; every context-parallel rank runs
    its slice of each sample (the answer's hits and losses summed over the cp group)."""
    rows = []
    for seq_length in lengths:
        local = np.concatenate([np.arange(a, b) for a, b in pstate.context_layout.token_ranges(seq_length,
                                                                                                pstate.cp_rank)])
        for depth in depths:
            retrieved, loss_sum, answer_tokens = 0, 0.0, 0
            for key in passkey_keys(trials, seed):
                sample = passkey_sample(tokenizer, seq_length, depth, key, haystack)
                inputs, labels, positions = (torch.as_tensor(a, device=device).unsqueeze(0)
                                             for a in (sample.ids[local], sample.ids[local + 1], local))
                with torch.no_grad():
                    losses, hits = model(inputs, positions, labels, (0, seq_length), per_token="greedy")
                is_answer = torch.as_tensor(np.isin(local, sample.answer), device=device)
                totals = torch.stack([(losses[0].double() * is_answer).sum(), (hits[0] & is_answer).sum().double()])
                if pstate.cp_size > 1:
                    dist.all_reduce(totals, group=pstate.cp_group)
                loss, hit = totals.tolist()
                retrieved += int(hit == len(sample.answer))
                loss_sum, answer_tokens = loss_sum + loss, answer_tokens + len(sample.answer)
            rows.append({"seq_length": seq_length, "depth": depth, "retrieved": retrieved / trials,
                         "answer_loss": loss_sum / answer_tokens})
    return {"trials": trials, "passkey": rows}


def _grid(result: dict) -> tuple[list[int], list[float], dict]:
    """(lengths, depths, retrieval rate by (length, depth)) of a `run_passkey` result."""
    rows = result["passkey"]
    rate = {(r["seq_length"], r["depth"]): r["retrieved"] for r in rows}
    return sorted({r["seq_length"] for r in rows}), sorted({r["depth"] for r in rows}), rate


def passkey_table(result: dict) -> str:
    """Retrieval rate by depth (rows) and length (columns)."""
    lengths, depths, rate = _grid(result)
    lines = [f"passkey retrieved ({result['trials']} keys each), depth x length", "depth  " + "".join(
        f"{length:>12,}" for length in lengths)]
    lines += [f"{d:5.2f}  " + "".join(f"{rate[(length, d)]:>12.0%}" for length in lengths) for d in depths]
    return "\n".join(lines)


def plot_passkey(result: dict, png: str) -> None:
    """The depth x length retrieval map as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, depths, rate = _grid(result)
    grid = np.array([[rate[(length, d)] for length in lengths] for d in depths])
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.5 * len(depths)))
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [f"{length:,}" for length in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set(xlabel="context length (tokens)", ylabel="depth of the key",
           title=f"passkey retrieved ({result['trials']} keys each)")
    fig.colorbar(image, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
