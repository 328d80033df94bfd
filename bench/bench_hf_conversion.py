"""Peak host memory of the Hugging Face conversion against the model's size.

    python -m bench.bench_hf_conversion --model llama3-3b --work-dir /tmp/conv

Writes a weights-only checkpoint of random fp32 weights for the flavour (streamed, so the
writer itself holds one tensor), then runs tools/checkpoint/convert_to_hf.py and
convert_from_hf.py in their own processes and reports each one's peak RSS (getrusage of
the child) next to the size of the checkpoint and of the bf16 export.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import subprocess
import sys
import time
from pathlib import Path

import torch

from megatron_lc.models.llama import build_model, get_config
from megatron_lc.training.hf_conversion import MODEL_PREFIX, StreamingSavePlanner
from megatron_lc.training import checkpointing

REPO = Path(__file__).resolve().parents[1]


def _random(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def write_random_checkpoint(model: str, root: Path) -> Path:
    config = get_config(model)
    shapes = {k: torch.empty(v.shape, device="meta") for k, v in build_model(config, device="meta").state_dict().items()}
    readers = {MODEL_PREFIX + k: functools.partial(_random, v.shape, i) for i, (k, v) in enumerate(shapes.items())}
    extra = {"model_config": dataclasses.asdict(config), "weights_only": True}
    return checkpointing.save_state(root, 0, {"model": shapes}, extra, planner=StreamingSavePlanner(readers))


def peak_rss_of(cmd: list[str]) -> tuple[float, float]:
    """(peak RSS GiB, seconds) of one child process: its VmHWM, read every 50 ms until it exits.

    Not getrusage: Linux carries a parent's peak RSS across fork and exec into the child's.
    """
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    peak_kib = 0
    while child.poll() is None:
        try:
            status = Path(f"/proc/{child.pid}/status").read_text()
            peak_kib = max(peak_kib, int(status.split("VmHWM:")[1].split()[0]))
        except (OSError, IndexError):
            pass
        time.sleep(0.05)
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed")
    return peak_kib / 2**20, time.perf_counter() - start


def _size_gib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-3b")
    p.add_argument("--work-dir", type=Path, required=True)
    args = p.parse_args()
    ckpt = write_random_checkpoint(args.model, args.work_dir / "ckpt")
    tool = REPO / "tools" / "checkpoint"
    hf, back = args.work_dir / "hf", args.work_dir / "back"
    to_rss, to_s = peak_rss_of([sys.executable, str(tool / "convert_to_hf.py"), "--load", str(ckpt), "--save", str(hf)])
    from_rss, from_s = peak_rss_of([sys.executable, str(tool / "convert_from_hf.py"), "--load", str(hf),
                                    "--save", str(back)])
    largest_shard = max(f.stat().st_size for f in hf.glob("*.safetensors")) / 2**30
    print(f"{args.model}: checkpoint {_size_gib(ckpt):.2f} GiB fp32, export {_size_gib(hf):.2f} GiB bf16, "
          f"largest shard {largest_shard:.2f} GiB")
    print("| conversion | peak RSS (GiB) | time (s) |\n| --- | ---: | ---: |")
    print(f"| checkpoint -> HF | {to_rss:.2f} | {to_s:.0f} |\n| HF -> checkpoint | {from_rss:.2f} | {from_s:.0f} |")


if __name__ == "__main__":
    main()
