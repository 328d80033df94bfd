"""The run spec: what the trainer, evaluate and the planner build from, derived from the config once."""

import dataclasses

import torch

from megatron_lc.arguments import parse_config
from megatron_lc.models.llama.parallelize import FSDPSettings
from tests.helpers import train_flags


def test_the_spec_holds_the_padded_model_the_datas_vocabulary_the_options_and_the_degrees():
    cfg = parse_config(train_flags("--vocab-size", "1000", "--make-vocab-size-divisible-by", "128",
                                   "--context-parallel-size", "2", "--tiled-loss", tiny_model=True))
    spec = cfg.run_spec(4)
    assert spec.model.vocab_size == 1024 and spec.data_vocab_size == 1000
    assert spec.model == cfg.model_config() and spec.parallelize == cfg.parallelize_options()
    assert spec.dims == cfg.parallel_dims(4) and spec.dims.cp == 2 and spec.dims.dp == 2
    assert spec.parallelize.memory.loss_tiles == cfg.memory_stack().loss_tiles


def test_a_tokenizers_vocabulary_or_a_checkpoints_model_is_the_specs():
    cfg = parse_config(train_flags(tiny_model=True))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=None))
    assert cfg.run_spec(1, vocab_size=300).model.vocab_size == 300
    checkpoint = dataclasses.replace(cfg.model_config(), vocab_size=77)
    spec = cfg.run_spec(1, model=checkpoint)
    assert spec.model is checkpoint and spec.data_vocab_size == 77


def test_the_fsdp_flags_are_the_specs_fsdp_settings_and_replicas():
    plain = parse_config(train_flags(tiny_model=True)).run_spec(2)
    assert plain.parallelize.fsdp == FSDPSettings(torch.float32, torch.float32, reshard_after_forward=True,
                                                  cpu_offload=False)
    assert plain.dims.dp_replicate == 1 and plain.dims.dp_shard == 2
    cfg = parse_config(train_flags("--bf16", "--no-reshard-after-forward", "--fsdp-cpu-offload",
                                   "--data-parallel-replicate", "2", tiny_model=True))
    fsdp_flags = {f.name for f in dataclasses.fields(cfg.fsdp)}
    assert fsdp_flags.isdisjoint(f.name for f in dataclasses.fields(cfg.parallel))  # each flag in one section
    spec = cfg.run_spec(4)
    assert spec.parallelize.fsdp == FSDPSettings(torch.bfloat16, torch.float32, reshard_after_forward=False,
                                                 cpu_offload=True)
    assert spec.dims.dp_replicate == 2 and spec.dims.dp_shard == 2


def test_a_preset_groups_the_fsdp_flags_under_fsdp_or_as_before_under_parallel(tmp_path):
    for section in ("fsdp", "parallel"):
        preset = tmp_path / f"{section}.yaml"
        preset.write_text(f"{section}:\n  fsdp_cpu_offload: true\n  data_parallel_replicate: 2\n")
        cfg = parse_config(["--config", str(preset)])
        assert cfg.fsdp.fsdp_cpu_offload and cfg.fsdp.data_parallel_replicate == 2
