"""The whole pipeline on CPU in a few minutes: `make demo`.

1. corpus     the Python documentation topics every Python installation carries (pydoc_data)
2. tokenizer  a small SentencePiece model trained on it      (tools/train_tokenizer.py)
3. preprocess Megatron .bin/.idx                              (tools/preprocess_data.py)
4. train      debug model, 2 processes, cp=2 Untied Ulysses, full checkpointing + offload,
              tiled MLP and loss, checkpoints                 (torchrun -m megatron_lc.train)
5. evaluate   loss by position on the held-out split          (python -m megatron_lc.evaluate)
6. convert    to Hugging Face, load with transformers, generate (tools/checkpoint/convert_to_hf.py)

Each step is the command a user would type; it is printed before it runs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
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


def write_corpus(work: Path) -> tuple[Path, Path]:
    """Every documentation topic is one document; every tenth goes to the validation split."""
    import pydoc_data.topics as topics

    train, valid = work / "corpus_train.jsonl", work / "corpus_valid.jsonl"
    with open(train, "w") as t, open(valid, "w") as v:
        for i, (name, text) in enumerate(sorted(topics.topics.items())):
            (v if i % 10 == 0 else t).write(json.dumps({"title": name, "text": text}) + "\n")
    return train, valid


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work-dir", default="runs/demo", help="where everything is written")
    p.add_argument("--train-iters", type=int, default=150)
    p.add_argument("--seq-length", type=int, default=512)
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
        "--valid-data-path", str(work / "valid_text_document"), "--seq-length", str(args.seq_length),
        "--micro-batch-size", "2", "--train-iters", str(args.train_iters), "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-warmup-iters", "5", "--weight-decay", "0.0", "--context-parallel-size", "2",
        "--cp-impl", "untied_ulysses", "--recompute-granularity", "full", "--offload-activations",
        "--tiled-mlp", "--tiled-loss", "--save", str(ckpt), "--save-interval", str(args.train_iters // 2),
        "--log-interval", "5", "--eval-interval", str(args.train_iters // 2), "--eval-iters", "2",
        "--log-dir", str(logs), "--tensorboard-dir", str(work / "tensorboard"), "--device", "cpu",
    ]
    print(run([py, "-m", "torch.distributed.run", "--nproc-per-node", "2", f"--master-port={free_port()}",
               "-m", "megatron_lc.train", *train_flags]))
    losses = [json.loads(line)["loss"] for line in (logs / "metrics.jsonl").read_text().splitlines()]
    print(f"loss: step 1 {losses[0]:.3f} -> step {args.train_iters} {losses[-1]:.3f}")

    print(run([py, "-m", "megatron_lc.evaluate", "--load", str(ckpt), "--data-path",
               str(work / "valid_text_document"), "--seq-length", str(args.seq_length),
               "--loss-by-position", "4", "--device", "cpu"]))
    hf_dir = work / "hf"
    run([py, "tools/checkpoint/convert_to_hf.py", "--load", str(ckpt), "--save", str(hf_dir),
         "--tokenizer-model", str(work / "spm.model"), "--dtype", "float32"])
    print(run([py, str(REPO / "examples/quickstart/generate.py"), str(hf_dir), "def "]))
    print(f"demo finished in {time.time() - start:.0f} s; everything is under {work}")


if __name__ == "__main__":
    main()
