"""The training entry point end to end: validation, multi-rank runs, resume, NaN handling."""

import pytest
import torch

from megatron_lc.errors import ConfigError
from megatron_lc.arguments import parse_config
from megatron_lc.training import checkpointing
from megatron_lc.training.trainer import NonFiniteError, train
from tests.helpers import TRAIN_FLAGS, logged_losses, torchrun_train

BASE = TRAIN_FLAGS


@pytest.mark.parametrize("flags, message", [
    (["--seq-length", "63", "--context-parallel-size", "2"], "--seq-length 63 is not divisible"),
    (["--context-parallel-size", "3", "--seq-length", "66"], "--num-attention-heads 8 is not divisible"),
    (["--offload-activations"], "--recompute-granularity full"),
    (["--global-batch-size", "3", "--micro-batch-size", "2"], "--global-batch-size 3"),
    (["--model", "llama-7t"], "llama-7t"),
    (["--train-iters", "0"], "--train-iters 0: nothing to train"),
    (["--log-interval", "0"], "--log-interval 0 must be >= 1"),
    (["--eval-interval", "1", "--eval-iters", "0"], "--eval-iters 0"),
    (["--eval-interval", "2"], "needs validation data"),
    (["--min-lr", "1e-2"], "--min-lr 0.01 is above --lr"),
    (["--finetune"], "--finetune reads the checkpoint in --load"),
    (["--context-parallel-size", "2", "--cp-impl", "untied_ulysses", "--untied-heads-per-stage", "3"],
     "--untied-heads-per-stage 3"),
    (["--attention-kernel", "sdpa_flash"], "--attention-kernel sdpa_flash takes fp16/bf16 only: add --bf16"),
])
def test_impossible_configurations_fail_before_any_work(flags, message):
    cfg = parse_config(BASE + flags)
    with pytest.raises(ValueError, match=message):
        cfg.validate(world_size=int(flags[flags.index("--context-parallel-size") + 1])
                     if "--context-parallel-size" in flags else 1)


def test_missing_dataset_names_the_file(tmp_path):
    cfg = parse_config(["--data-path", str(tmp_path / "corpus_text_document")])
    with pytest.raises(ConfigError, match="corpus_text_document.bin"):
        cfg.validate(world_size=1)


def test_preset_file_sets_defaults_and_flags_win(tmp_path):
    preset = tmp_path / "run.yaml"
    preset.write_text("data:\n  seq_length: 256\n  mock_data: true\nmemory:\n  recompute_granularity: full\n")
    cfg = parse_config(["--config", str(preset), "--seq-length", "128"])
    assert cfg.data.seq_length == 128 and cfg.data.mock_data and cfg.memory.recompute_granularity == "full"


def test_interrupted_run_resumes_with_the_losses_of_an_uninterrupted_one(tmp_path):
    whole = train(parse_config(BASE + ["--train-iters", "4", "--log-dir", str(tmp_path / "whole")]))
    save = str(tmp_path / "ckpt")
    first = train(parse_config(BASE + ["--train-iters", "4", "--save", save, "--save-interval", "2",
                                       "--exit-interval", "2", "--log-dir", str(tmp_path / "a")]))
    assert len(first) == 2
    rest = train(parse_config(BASE + ["--train-iters", "4", "--load", save, "--log-dir", str(tmp_path / "b")]))
    assert [m["step"] for m in rest] == [3, 4]
    assert [m["loss"] for m in first + rest] == pytest.approx([m["loss"] for m in whole], rel=1e-6)


def test_half_written_checkpoint_is_never_picked(tmp_path):
    (tmp_path / ".tmp_iter_0000004").mkdir()
    (tmp_path / "iter_0000003").mkdir()  # no meta.json: incomplete
    assert checkpointing.latest_checkpoint(tmp_path) is None


def test_two_rank_context_parallel_run_resumes_on_one_rank(tmp_path):
    """torchrun, cp=2, Untied-free stack on; its checkpoint resumes in one process, same losses."""
    reference = train(parse_config(BASE + ["--train-iters", "3", "--log-dir", str(tmp_path / "ref")]))
    stack = ["--recompute-granularity", "full", "--offload-activations", "--tiled-mlp", "--tiled-loss"]
    torchrun_train(2, BASE + stack + ["--context-parallel-size", "2", "--train-iters", "3", "--save", "ckpt",
                                 "--exit-interval", "2", "--log-dir", "cp2", "--tensorboard-dir", "tb"], tmp_path)
    assert any((tmp_path / "tb").iterdir())
    resumed = train(parse_config(BASE + ["--train-iters", "3", "--load", str(tmp_path / "ckpt"),
                                         "--log-dir", str(tmp_path / "one")]))
    losses = logged_losses(tmp_path / "cp2") + [m["loss"] for m in resumed]
    assert losses == pytest.approx([m["loss"] for m in reference], rel=1e-5)


def test_nonfinite_loss_stops_with_the_step_or_is_skipped(tmp_path):
    blowup = BASE + ["--train-iters", "4", "--lr", "1e30", "--clip-grad", "0", "--log-dir", str(tmp_path)]
    with pytest.raises(NonFiniteError, match=r"step \d: loss"):
        train(parse_config(blowup))
    history = train(parse_config(blowup + ["--skip-nonfinite"]))
    assert len(history) == 4


def test_one_process_bf16_keeps_fp32_master_weights_and_computes_in_bf16(tmp_path):
    from megatron_lc.training.trainer import build_run, train_one_step

    flags = BASE + ["--lr", "1e-6", "--min-lr", "0", "--lr-decay-style", "constant", "--train-iters", "1", "--clip-grad", "0"]
    fp32, bf16 = build_run(parse_config(flags)), build_run(parse_config(flags + ["--bf16"]))
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    before = [p.detach().clone() for p in bf16.model.parameters()]
    loss_fp32, loss_bf16 = train_one_step(fp32, 1)["loss"], train_one_step(bf16, 1)["loss"]
    assert loss_bf16 != loss_fp32 and loss_bf16 == pytest.approx(loss_fp32, rel=1e-2)  # bf16 matmuls ran
    # An update of ~1e-6 is below bf16's resolution at these magnitudes: only fp32 weights keep it.
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(bf16.model.parameters(), before))
    assert changed > 0.9 * sum(b.numel() for b in before)


def test_logged_host_offload_peak_is_the_steps_own():
    """metrics' host_offload_gib is the peak of host bytes in use during that step, not since the run began: what
    an earlier step held (or an evaluation at another length) must not show in the next step's figure."""
    from megatron_lc.training.trainer import build_run, train_one_step

    run = build_run(parse_config(BASE + ["--recompute-granularity", "full", "--offload-activations",
                                         "--train-iters", "2"]))
    first = train_one_step(run, 1)["host_offload_gib"]
    assert first > 0
    run.offload.host_bytes_peak += 2**30  # a larger peak before this step
    assert train_one_step(run, 2)["host_offload_gib"] == first


def test_train_accepts_every_tokenizer_type_preprocessing_accepts():
    from megatron_lc.data.preprocess_cli import build_parser as preprocess_parser
    from megatron_lc.data.tokenizers import TOKENIZER_TYPES

    action = next(a for a in preprocess_parser()._actions if "--tokenizer-type" in a.option_strings)
    assert set(action.choices) == set(TOKENIZER_TYPES)
    for name in TOKENIZER_TYPES:
        assert parse_config(["--tokenizer-type", name]).data.tokenizer_type == name


def test_sparse_offload_run_killed_mid_step_resumes_bit_identically(tmp_path, monkeypatch):
    """k = 2 over 4 layers (segments {0, 1}, {2}): a run killed in step 3's backward, after its replay
    began, resumes from step 2's checkpoint with exactly the losses and gradient norms of a run never
    stopped; and those equal k = 1's exactly (the replay is the forward again)."""
    from megatron_lc.memory.offload import OffloadScheduler

    flags = BASE + ["--num-layers", "4", "--recompute-granularity", "full", "--offload-activations",
                    "--train-iters", "4"]
    sparse = flags + ["--offload-every-k-layers", "2"]
    whole = train(parse_config(sparse + ["--log-dir", str(tmp_path / "whole")]))
    dense = train(parse_config(flags + ["--log-dir", str(tmp_path / "dense")]))
    fetch, calls = OffloadScheduler.fetch, []

    class Killed(Exception):
        pass

    def dying_fetch(self, handle, keep=False):
        calls.append(keep)
        if len(calls) == 2 * 3 + 2:  # 3 fetches a step (layers 2, 1, 0); step 3 dies at layer 1's, to replay from
            raise Killed("killed mid-step")
        return fetch(self, handle, keep)

    monkeypatch.setattr(OffloadScheduler, "fetch", dying_fetch)
    save = str(tmp_path / "ckpt")
    with pytest.raises(Killed):
        train(parse_config(sparse + ["--save", save, "--save-interval", "2", "--log-dir", str(tmp_path / "a")]))
    assert calls[-1] is True  # it died fetching a kept input to replay from
    monkeypatch.setattr(OffloadScheduler, "fetch", fetch)
    rest = train(parse_config(sparse + ["--load", save, "--log-dir", str(tmp_path / "b")]))
    assert [m["step"] for m in rest] == [3, 4]
    first = logged_losses(tmp_path / "a")
    assert first + [m["loss"] for m in rest] == [m["loss"] for m in whole] == [m["loss"] for m in dense]
    assert [m["grad_norm"] for m in rest] == [m["grad_norm"] for m in whole[2:]]
