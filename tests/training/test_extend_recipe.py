"""examples/extend_llama3_8b.sh, run through its own commands on a tiny Llama-3.1-shaped model on CPU: convert, a
rope change, growing lengths that continue one token stream and one schedule, the passkey test after each
stage, and an export transformers reads with the trained rope and length."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from megatron_lc.training import checkpointing
from tests.helpers import write_random_dataset

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]


def test_the_extension_recipe_runs_its_stages_on_a_tiny_model(tmp_path):
    hf_config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=False, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    transformers.LlamaForCausalLM(hf_config).save_pretrained(tmp_path / "hf")
    data = write_random_dataset(tmp_path / "corpus", documents=300, lengths=(20, 200), vocab=250, seed=1)
    env = {**os.environ, "STAGES": "128 256", "STEPS": "2", "CP": "1", "LAUNCH": "python",
           "TOKENIZER_TYPE": "ByteTokenizer", "ROPE_FLAGS": "--rotary-base 2000000", "PASSKEY_TRIALS": "1",
           "MEMORY_FLAGS": "--recompute-granularity full --tiled-loss", "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(os.sys.executable).parent}:{os.environ['PATH']}"}
    recipe = ["bash", "examples/extend_llama3_8b.sh", str(tmp_path / "hf"), data, "none", str(tmp_path / "work"),
              "--device", "cpu"]
    work = tmp_path / "work"
    # A stage preempted while it starts (SIGTERM to its process once it has loaded the converted weights): the
    # script stops with the resume status instead of moving on.
    stopped = _preempted_while_starting(recipe, env, "model settings changed on load")
    assert stopped.returncode == 3, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert "stage 128 stopped to be resumed at step 0: run this script again to go on" in stopped.stdout
    assert not (work / "logs" / "stage_256").exists() and not list(work.glob("passkey_*"))
    out = subprocess.run(recipe, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "rotary_base 500000.0 -> 2000000.0" in out.stdout  # the rope change, said once, at the first stage
    assert "the token stream continues at token" in out.stdout  # the second stage goes on from the first
    meta = checkpointing.read_meta(checkpointing.latest_checkpoint(work / "ckpt"))
    assert meta["step"] == 4 and meta["model_config"]["max_position_embeddings"] == 256
    for length in (128, 256):
        result = json.loads((work / f"passkey_{length}.txt").read_text().strip().splitlines()[-1])
        assert [row["seq_length"] for row in result["passkey"]] == [length] * 5
        assert (work / f"passkey_{length}.png").exists()
    exported = json.loads((work / "hf-extended" / "config.json").read_text())
    assert exported["rope_theta"] == 2e6 and exported["rope_scaling"]["rope_type"] == "llama3"
    assert exported["max_position_embeddings"] == 256
    assert transformers.LlamaForCausalLM.from_pretrained(work / "hf-extended").config.max_position_embeddings == 256
    # Run again: nothing is converted, trained or tested twice; the export is written again from the same step.
    again = subprocess.run(recipe, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "step " not in again.stdout and "passkey" not in again.stdout
    assert checkpointing.read_meta(checkpointing.latest_checkpoint(work / "ckpt"))["step"] == 4


def _preempted_while_starting(recipe: list[str], env: dict, after: str) -> subprocess.CompletedProcess:
    """Run `recipe` and send SIGTERM to the process it launched once that process has printed `after`."""
    proc = subprocess.Popen(recipe, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if after in line:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            for pid in children:
                os.kill(int(pid), signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(recipe, proc.returncode, "".join(lines) + out, err)
