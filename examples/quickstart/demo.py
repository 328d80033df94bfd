"""The whole pipeline on CPU in a few minutes: `make demo`.

1. corpus     the Python documentation topics every Python installation carries (pydoc_data),
              and passages of 32 letters drawn at random, each followed by a repeat of itself:
              nothing but the passage's own first half predicts its second half
2. tokenizer  a small SentencePiece model trained on it      (tools/train_tokenizer.py)
3. preprocess Megatron .bin/.idx                              (tools/preprocess_data.py)
4. train      debug model, 2 processes, cp=2 Untied Ulysses, full checkpointing + offload,
              tiled MLP and loss, checkpoints                 (torchrun -m megatron_lc.train)
5. evaluate   loss by position on the held-out split, and on samples of new random passages,
              each followed by its repeat, one straddling the cp split: a low loss on a repeat
              whose first half is on the other rank is the model reading context across ranks
              (torchrun -m megatron_lc.evaluate; a PNG plot of loss by position)
6. convert    to Hugging Face, load with transformers, continue a repeated passage
7. chat       a chat fine-tune: conversations (OpenAI `messages`) rendered by a tokenizer's own chat
              template with an assistant-only loss mask (tools/preprocess_data.py --chat-template hf),
              whole conversations packed into samples (--packing documents), cp=2 ring attention;
              exported to Hugging Face and answered by transformers' generate() through the template

Each step is the command a user would type; it is printed before it runs.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import socket
import string
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(cmd: list[str]) -> str:
    print("\n$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    out = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True)
    if out.returncode:
        sys.exit(f"step failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return out.stdout


PASSAGE_LETTERS = 32  # a passage and its repeat: about 64 tokens, one letter each
TRAIN_PASSAGES = 3000


def random_passages(count: int, seed: int) -> list[str]:
    """`count` passages of letters drawn at random: nothing but a passage's first half predicts its repeat."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(string.ascii_lowercase, k=PASSAGE_LETTERS)) for _ in range(count)]


def write_corpus(work: Path) -> tuple[Path, Path]:
    """Every documentation topic is one document, every tenth in the validation split; the training
    split also gets the repeated random passages."""
    import pydoc_data.topics as topics

    texts = [text for _, text in sorted(topics.topics.items())]
    repeats = [f"{p} {p}" for p in random_passages(TRAIN_PASSAGES, seed=0)]
    train_texts = [t for i, t in enumerate(texts) if i % 10] + repeats
    train, valid = work / "corpus_train.jsonl", work / "corpus_valid.jsonl"
    train.write_text("".join(json.dumps({"text": t}) + "\n" for t in train_texts))
    valid.write_text("".join(json.dumps({"text": t}) + "\n" for i, t in enumerate(texts) if i % 10 == 0))
    return train, valid


PROBE_HALF = 32  # tokens in a probe passage; its repeat is the next 32 (the last one an EOD)


def write_repeat_probe(work: Path, tokenizer_model: Path, seq_length: int) -> Path:
    """Held-out samples of exactly seq_length tokens from new passages (another seed than training's):
    a 32-token opening, passages of 32 tokens each followed by its repeat, a 32-token close; each
    piece is a document. Every sample starts a document, so positions line up across samples:
    with cp=2 rank 0 holds [0, S/2) and rank 1 [S/2, S), and the passage at [S/2 - 32, S/2 + 32)
    has its first half on rank 0 and its repeat on rank 1."""
    from megatron_lc.data.indexed_dataset import IndexedDatasetBuilder
    from megatron_lc.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model)
    prefix, passages = work / "repeat_probe", iter(random_passages(10_000, seed=1))
    pieces_per_sample = seq_length // (2 * PROBE_HALF) + 1  # opening, repeated passages, close
    with IndexedDatasetBuilder(f"{prefix}.bin") as builder:
        for i in range(32 * pieces_per_sample):
            ids = tokenizer.tokenize(next(passages))[:PROBE_HALF]
            opening_or_close = i % pieces_per_sample in (0, pieces_per_sample - 1)
            builder.add_item(ids[:-1] + [tokenizer.eod] if opening_or_close else ids + ids[:-1] + [tokenizer.eod])
            builder.end_document()
        builder.finalize(f"{prefix}.idx")
    return prefix


def probe_losses(result: dict, seq_length: int) -> dict[str, float]:
    """Mean loss on the probe's first halves, on their repeats, and on the repeat across the cp split."""
    buckets = [b["loss"] for b in result["loss_by_position"]]  # one per 32 positions
    first, repeat = buckets[1:-1:2], buckets[2:-1:2]
    across = buckets[seq_length // 2 // PROBE_HALF]
    return {"first": sum(first) / len(first), "repeat": sum(repeat) / len(repeat), "across": across}


def plot_loss_by_position(result: dict, seq_length: int, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = result["loss_by_position"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([(b["start"] + b["end"]) / 2 for b in buckets], [b["loss"] for b in buckets], marker="o")
    ax.axvline(seq_length // 2, color="grey", linestyle="--")
    ax.text(seq_length // 2, ax.get_ylim()[1], " cp rank 0 | rank 1", va="top", fontsize=8)
    ax.set(xlabel="position in the sample (32-token buckets: passage, repeat, passage, ...)",
           ylabel="loss (nats per token)", title="new random passages, each followed by its repeat")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


CHAT_WORDS = ("red", "green", "blue", "black", "white", "north", "south", "east", "west", "cat", "dog", "fish")


def write_chat_corpus(work: Path, count: int = 400) -> Path:
    """Conversations whose assistant repeats the user's words in reverse order: only the assistant's turns are
    trained on, so what the model learns is to answer, not to write user turns."""
    rng = random.Random(3)
    path = work / "chat.jsonl"
    with path.open("w") as f:
        for _ in range(count):
            words = [rng.choice(CHAT_WORDS) for _ in range(rng.randint(2, 4))]
            messages = [{"role": "system", "content": "Reverse the words."},
                        {"role": "user", "content": " ".join(words)},
                        {"role": "assistant", "content": " ".join(reversed(words))}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def chat_fine_tune(work: Path, py: str, iters: int) -> None:
    """Step 7: chat data -> ids and a loss mask -> packed training under cp 2 ring -> Hugging Face -> generate."""
    from megatron_lc.testing import write_chat_tokenizer

    chat = write_chat_corpus(work)
    tokenizer = write_chat_tokenizer(work / "chat_tokenizer", [" ".join(CHAT_WORDS) * 4, "Reverse the words."] * 50,
                                     vocab_size=400)
    tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer)]
    print(run([py, "tools/preprocess_data.py", "--input", str(chat), "--output-prefix", str(work / "chat"),
               "--json-keys", "messages", "--chat-template", "hf", *tok, "--workers", "1",
               "--no-progress"]).strip().splitlines()[-1])
    ckpt, logs = work / "chat_checkpoints", work / "chat_logs"
    print(run([py, "-m", "torch.distributed.run", "--nproc-per-node", "2", f"--master-port={free_port()}",
               "-m", "megatron_lc.train", "--model", "debug", *tok, "--data-path", str(work / "chat_messages_document"),
               "--split", "100,0,0", "--packing", "documents", "--seq-length", "256", "--micro-batch-size", "4",
               "--context-parallel-size", "2", "--cp-comm-type", "p2p", "--train-iters", str(iters),
               "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "5", "--weight-decay", "0.0",
               "--log-interval", "50", "--save", str(ckpt), "--log-dir", str(logs), "--device", "cpu"]))
    hf_dir = work / "hf_chat"
    run([py, "tools/checkpoint/convert_to_hf.py", "--load", str(ckpt), "--save", str(hf_dir)])
    print(run([py, str(REPO / "examples/quickstart/generate.py"), str(hf_dir), "blue cat north", "--chat"]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work-dir", default="runs/demo", help="where everything is written")
    p.add_argument("--train-iters", type=int, default=1000)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--chat-iters", type=int, default=400, help="steps of the chat fine-tune (step 7)")
    args = p.parse_args()
    start = time.time()
    work = (REPO / args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable

    train_jsonl, valid_jsonl = write_corpus(work)
    print(f"corpus: {train_jsonl} and {valid_jsonl}")
    run([py, "tools/train_tokenizer.py", "--input", str(train_jsonl), "--output-prefix", str(work / "spm"),
         "--vocab-size", "1024"])
    tok = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(work / "spm.model")]
    for split, src in (("train", train_jsonl), ("valid", valid_jsonl)):
        print(run([py, "tools/preprocess_data.py", "--input", str(src), "--output-prefix", str(work / split),
                   *tok, "--append-eod", "--workers", "1", "--no-progress"]).strip().splitlines()[-1])

    ckpt, logs = work / "checkpoints", work / "logs"
    train_flags = [
        "--model", "debug", *tok, "--data-path", str(work / "train_text_document"),
        "--split", "100,0,0", "--valid-data-path", str(work / "valid_text_document"), "--seq-length", str(args.seq_length),
        "--reset-attention-mask", "--micro-batch-size", "2", "--train-iters", str(args.train_iters),
        "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-warmup-iters", "5", "--weight-decay", "0.0", "--context-parallel-size", "2",
        "--cp-impl", "untied_ulysses", "--recompute-granularity", "full", "--offload-activations",
        "--tiled-mlp", "--tiled-loss", "--save", str(ckpt), "--save-interval", str(args.train_iters // 2),
        "--log-interval", "25", "--eval-interval", str(args.train_iters // 2), "--eval-iters", "2",
        "--log-dir", str(logs), "--tensorboard-dir", str(work / "tensorboard"), "--device", "cpu",
    ]
    print(run([py, "-m", "torch.distributed.run", "--nproc-per-node", "2", f"--master-port={free_port()}",
               "-m", "megatron_lc.train", *train_flags]))
    losses = [json.loads(line)["loss"] for line in (logs / "metrics.jsonl").read_text().splitlines()]
    print(f"loss: step 1 {losses[0]:.3f} -> step {args.train_iters} {losses[-1]:.3f}")

    print(run([py, "-m", "megatron_lc.evaluate", "--load", str(ckpt), "--data-path",
               str(work / "valid_text_document"), "--seq-length", str(args.seq_length), "--reset-attention-mask",
               "--loss-by-position", "4", "--device", "cpu"]))
    probe = write_repeat_probe(work, work / "spm.model", args.seq_length)
    out = run([py, "-m", "torch.distributed.run", "--nproc-per-node", "2", f"--master-port={free_port()}",
               "-m", "megatron_lc.evaluate", "--load", str(ckpt), "--data-path", str(probe), "--seq-length",
               str(args.seq_length), "--reset-attention-mask", "--context-parallel-size", "2",
               "--cp-impl", "untied_ulysses", "--loss-by-position-in", "sample",
               "--loss-by-position", str(args.seq_length // PROBE_HALF), "--device", "cpu"])
    result = json.loads(out.strip().splitlines()[-1])
    loss = probe_losses(result, args.seq_length)
    png = work / "loss_by_position.png"
    plot_loss_by_position(result, args.seq_length, png)
    print(f"repeat probe ({result['samples']} samples of new passages): loss {loss['first']:.2f} on first "
          f"halves, {loss['repeat']:.2f} on their repeats, {loss['across']:.2f} on the repeat whose first half "
          f"is on the other cp rank; plot in {png}")
    passkey_png = work / "passkey.png"  # a key hidden in the validation text: retrieved by greedy decoding?
    print(run([py, "-m", "megatron_lc.evaluate", "--load", str(ckpt), "--passkey", "--seq-length",
               str(args.seq_length), "--passkey-lengths", str(args.seq_length // 2), str(args.seq_length),
               "--passkey-trials", "2", "--data-path", str(work / "valid_text_document"),
               "--passkey-plot", str(passkey_png), "--device", "cpu"]).split("{")[0].rstrip())
    print(f"(plot in {passkey_png}; this model never saw a passkey question: the repeat probe above is the "
          "context it learned to read, and a model extended with examples/extend_llama3_8b.sh is what this "
          "test is for)")
    hf_dir = work / "hf"
    run([py, "tools/checkpoint/convert_to_hf.py", "--load", str(ckpt), "--save", str(hf_dir),
         "--tokenizer-model", str(work / "spm.model"), "--dtype", "float32"])
    passage = random_passages(1, seed=2)[0]
    print(run([py, str(REPO / "examples/quickstart/generate.py"), str(hf_dir), passage + " " + passage[:21]]))
    chat_fine_tune(work, py, args.chat_iters)
    print(f"demo finished in {time.time() - start:.0f} s; everything is under {work}")


if __name__ == "__main__":
    main()
