"""One dataclass tree for a training run, composed of the sections that live beside the rooms applying them.

Each section is a dataclass of flag fields (`flags.flag`) in its room: the model's in `models.llama.zoo`,
context parallelism's in `attention.context_parallel`, FSDP's in `models.llama.parallelize`, the memory
stack's in `memory.stack`, the data's in `data.sources`, the optimizer's, the run's, checkpoints' and logging's
in `training.args`. This module keeps `TrainConfig`, the sections' list and the rules that span sections:
`TrainConfig.validate(world_size)` rejects impossible combinations before any process group or accelerator memory
is touched, naming the flag and the fix. The command line and `--config` presets are `arguments`'.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import torch

from megatron_lc.attention.context_parallel import ContextParallel, ParallelArgs
from megatron_lc.data.sources import DataArgs, read_data_args, read_per_split_data_args, validate_data_flags
from megatron_lc.errors import ConfigError
from megatron_lc.memory.chunks import plan_chunks
from megatron_lc.memory.stack import MemoryArgs, MemoryStack
from megatron_lc.models.llama.model import LlamaConfig
from megatron_lc.models.llama.parallelize import FSDPArgs, ParallelizeOptions
from megatron_lc.models.llama.zoo import (FLAVOURS, ModelArgs, config_from_dict, get_config, padded_vocab_size,
                                          rope_scaling_from_flags)
from megatron_lc.parallel_state import ParallelDims
from megatron_lc.training.args import CheckpointArgs, LoggingArgs, OptimArgs, TrainArgs
from megatron_lc.training.profiling import ProfilingArgs
from megatron_lc.data.packing import PackingArgs, check_packing


SECTIONS = {
    "model": ModelArgs, "parallel": ParallelArgs, "fsdp": FSDPArgs, "memory": MemoryArgs, "data": DataArgs,
    "packing": PackingArgs,
    "optim": OptimArgs, "train": TrainArgs, "checkpoint": CheckpointArgs, "logging": LoggingArgs,
    "profiling": ProfilingArgs,
}


@dataclass(frozen=True)
class RunSpec:
    """What a run is built from, derived from its TrainConfig once (`TrainConfig.run_spec`): the trainer and
    evaluate build from it, and the planner (its traces, layer counts, time model and search) reads the model, the
    memory stack, the cp spec and the degrees from it, rather than deriving each piece again."""

    model: LlamaConfig
    """The model: the flavour with the overrides (or a checkpoint's), the vocabulary padded."""
    data_vocab_size: int
    """The ids the data may hold: the vocabulary before padding (--make-vocab-size-divisible-by)."""
    parallelize: ParallelizeOptions
    """Context parallelism, the memory stack and FSDP's settings (`parallelize_options`)."""
    dims: ParallelDims
    """The parallel degrees on the run's world."""


@dataclass
class TrainConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    fsdp: FSDPArgs = field(default_factory=FSDPArgs)
    memory: MemoryArgs = field(default_factory=MemoryArgs)
    data: DataArgs = field(default_factory=DataArgs)
    packing: PackingArgs = field(default_factory=PackingArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    profiling: ProfilingArgs = field(default_factory=ProfilingArgs)

    def tokenizer_spec(self):
        """The tokenizer the flags name (NullTokenizer's N is --vocab-size), or None without --tokenizer-type."""
        from megatron_lc.data.tokenizers import TokenizerSpec

        d = self.data
        if not d.tokenizer_type:
            return None
        null = d.tokenizer_type == "NullTokenizer"
        return TokenizerSpec(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file,
                             self.model.vocab_size if null else None)

    def vocab_size_override(self) -> int | None:
        """--vocab-size as the model's vocabulary; with NullTokenizer it is the tokenizer's N, whose
        vocabulary is N + 1 (EOD = N), as in Megatron-LM."""
        if self.model.vocab_size is not None and self.data.tokenizer_type == "NullTokenizer":
            return self.model.vocab_size + 1
        return self.model.vocab_size

    def model_config(self, vocab_size: int | None = None, padded: bool = True):
        """The LlamaConfig of the run: the flavour with the overrides applied, its vocabulary padded to a
        multiple of --make-vocab-size-divisible-by (unless `padded` is False: the ids the data may hold)."""
        return self._padded(self._unpadded_model_config(vocab_size), padded)

    def _padded(self, config, padded: bool = True):
        """`config` with its vocabulary padded to --make-vocab-size-divisible-by (as is, unless `padded`)."""
        multiple = self.model.make_vocab_size_divisible_by
        if not padded or multiple <= 1 or config.vocab_size % multiple == 0:
            return config
        return dataclasses.replace(config, vocab_size=padded_vocab_size(config.vocab_size, multiple))

    def _unpadded_model_config(self, vocab_size: int | None):
        m = self.model
        base = config_from_dict(m.checkpoint_model) if m.checkpoint_model else None
        if base is None and m.model not in FLAVOURS:
            return get_config(m.model)  # refused, naming the flavours
        scaling = rope_scaling_from_flags(
            (base or FLAVOURS[m.model]).rope_scaling, m.use_rope_scaling, m.rope_scaling_factor,
            rope_type=m.rope_scaling_type, original_max_position_embeddings=m.rope_scaling_original_max_position_embeddings,
            low_freq_factor=m.rope_scaling_low_freq_factor, high_freq_factor=m.rope_scaling_high_freq_factor,
            beta_fast=m.rope_scaling_beta_fast, beta_slow=m.rope_scaling_beta_slow,
            attention_factor=m.rope_scaling_attention_factor)
        config = get_config(m.model, base, num_layers=m.num_layers, hidden_size=m.hidden_size,
                          ffn_hidden_size=m.ffn_hidden_size, num_attention_heads=m.num_attention_heads,
                          num_query_groups=m.num_query_groups, kv_channels=m.kv_channels,
                          vocab_size=self.vocab_size_override() or (None if base else vocab_size),
                          rotary_base=m.rotary_base,
                          norm_eps=m.norm_epsilon, max_position_embeddings=m.max_position_embeddings,
                          init_std=m.init_method_std, rope_scaling=scaling,
                          tie_embeddings=False if m.untie_embeddings_and_output_weights else None)
        dynamic = config.rope_scaling is not None and config.rope_scaling.rope_type == "dynamic"
        if m.max_position_embeddings is None and config.max_position_embeddings < self.data.seq_length and not dynamic:
            config = dataclasses.replace(config, max_position_embeddings=self.data.seq_length)  # what is trained
        return config

    def memory_stack(self) -> MemoryStack:
        """The run's memory stack (`memory.stack`), tile counts resolved by the chunk scheduler."""
        c = self.model_config()
        local_tokens = self.data.micro_batch_size * self.data.seq_length // self.parallel.context_parallel_size
        chunks = plan_chunks(local_tokens, c.hidden_size, c.ffn_hidden_size, c.vocab_size, 2 if self.train.bf16 else 4,
                             mlp_tiles=self.memory.tiled_mlp_tiles, loss_tiles=self.memory.tiled_loss_tiles)
        return self.memory.stack(c.num_layers, chunks)

    def context_parallel(self) -> ContextParallel:
        """The run's context-parallel attention (`attention.context_parallel`)."""
        p = self.parallel
        layout = self.context_layout()
        return ContextParallel(layout=layout, documents=layout.documents, impl=p.cp_impl,
                               heads_per_stage=p.untied_heads_per_stage,
                               overlap=p.untied_overlap_stages, untied_backward=p.untied_backward,
                               ring_kv_grads=p.ring_kv_grads, kernel=p.attention_kernel,
                               flash_impl=p.flash_attention_impl)

    def parallelize_options(self) -> ParallelizeOptions:
        """The ParallelizeOptions of the run: its context parallelism, memory stack and FSDP settings."""
        fsdp = self.fsdp.settings(torch.bfloat16 if self.train.bf16 else torch.float32)
        return ParallelizeOptions(cp=self.context_parallel(), memory=self.memory_stack(), fsdp=fsdp,
                                  seq_length=self.data.seq_length)

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """The run's parallel degrees on `world_size` ranks (`parallel_state.ParallelDims`)."""
        p = self.parallel
        return ParallelDims(world_size, cp=p.context_parallel_size, dp_replicate=self.fsdp.data_parallel_replicate,
                            cp_ring=self.context_layout().ring_size)

    def run_spec(self, world_size: int, vocab_size: int | None = None, model: LlamaConfig | None = None) -> RunSpec:
        """The run's spec on `world_size` ranks: `vocab_size` is the tokenizer's (as `model_config` takes it);
        `model` a model config given whole (evaluate: the checkpoint's), its vocabulary the data's."""
        if model is None:
            unpadded = self._unpadded_model_config(vocab_size)
            model, data_vocab = self._padded(unpadded), unpadded.vocab_size
        else:
            data_vocab = model.vocab_size
        return RunSpec(model, data_vocab, self.parallelize_options(), self.parallel_dims(world_size))

    def global_batch(self, world_size: int) -> int:
        """Samples per optimizer step (--global-batch-size, default micro-batch x data-parallel size)."""
        return self.data.global_batch_size or self.data.micro_batch_size * (world_size // self.parallel.context_parallel_size)

    def resolved(self, world_size: int) -> TrainConfig:
        """This config with what other flags imply filled in, as Megatron-LM fills it: --train-iters from
        --train-samples (or 10), --data-path from --data-args-path, the per-split paths from
        --per-split-data-args-path. Idempotent; run after `validate`."""
        t, d = self.train, self.data
        train = t
        if t.train_iters is None:
            iters = t.train_samples // self.global_batch(world_size) if t.train_samples else 10
            train = dataclasses.replace(t, train_iters=iters)
        data = d
        paths = {name: os.path.abspath(getattr(d, name)) for name in ("tokenizer_model", "vocab_file", "merge_file")
                 if getattr(d, name) and os.path.exists(getattr(d, name)) and not os.path.isabs(getattr(d, name))}
        if paths:  # recorded in checkpoints: a conversion from another directory finds them
            data = dataclasses.replace(data, **paths)
        if d.data_args_path:
            data = dataclasses.replace(data, data_path=read_data_args(d.data_args_path), data_args_path=None)
        if d.per_split_data_args_path:
            parts = read_per_split_data_args(d.per_split_data_args_path)
            data = dataclasses.replace(data, per_split_data_args_path=None, train_data_path=parts["train"],
                                       valid_data_path=parts["valid"], test_data_path=parts["test"])
        if train is t and data is d:
            return self
        return dataclasses.replace(self, train=train, data=data)

    def context_layout(self):
        """The two levels of context parallelism (`megatron_lc.context_layout`) the flags ask for."""
        from megatron_lc.context_layout import context_layout_from_flags

        p = self.parallel
        layout = context_layout_from_flags(p.context_parallel_size, p.cp_comm_type,
                                           p.hierarchical_context_parallel_sizes)
        documents = p.cp_document_layout or ("split" if layout.ring_size > 1 else "sequence")
        return dataclasses.replace(layout, documents=documents)

    def attention_call(self):
        """The shape of this run's largest attention kernel call (`attention.flash_impl.AttentionCallShape`): a
        micro-batch's sequences, whole after the all-to-all, a ring's share with one; one document per sample (with
        --reset-attention-mask, the documents of a sample are not known before the data: one is assumed)."""
        import torch

        from megatron_lc.attention.flash_impl import AttentionCallShape

        c = self.model_config()
        return AttentionCallShape(
            self.data.micro_batch_size * self.data.seq_length // self.context_layout().ring_size,
            self.data.micro_batch_size, c.kv_channels, c.num_attention_heads // c.num_query_groups,
            torch.bfloat16 if self.train.bf16 else torch.float32)

    def validate(self, world_size: int) -> None:
        """Every impossible combination, with the reason and the fix, before any GPU time is spent. Rules
        only: what the run needs of disks, packages and hardware is `training.preflight`'s (the planner,
        which plans for another machine, does not run it)."""
        try:
            self._check_flag_sources()
            resolved = self.resolved(world_size)
            for check in (resolved._check_data, resolved._check_parallel, resolved._check_memory,
                          resolved._check_model, resolved._check_run, resolved._check_schedule,
                          resolved._check_checkpoint, resolved._check_megatron_flags):
                check(world_size)
        except ConfigError:
            raise
        except (ValueError, OSError, ImportError) as e:  # a missing file or package named by the check
            raise ConfigError(str(e)) from e

    def _check_flag_sources(self) -> None:
        """Flags that give one setting two ways (Megatron-LM asserts the same)."""
        t, o, d = self.train, self.optim, self.data
        if t.train_samples is not None:
            if t.train_iters is not None:
                raise ConfigError(f"--train-samples {t.train_samples} and --train-iters {t.train_iters}: give one")
            if t.train_samples < 1:
                raise ConfigError(f"--train-samples {t.train_samples}: nothing to train; give at least 1")
            for name, value in (("--lr-decay-iters", o.lr_decay_iters), ("--lr-wsd-decay-iters", o.lr_wsd_decay_iters),
                                ("--lr-warmup-iters", o.lr_warmup_iters or None)):
                if value is not None:
                    raise ConfigError(f"{name} {value} with --train-samples: the schedule counts samples; give "
                                      f"{name.replace('-iters', '-samples')}")
        else:
            for name, value in (("--lr-decay-samples", o.lr_decay_samples),
                                ("--lr-wsd-decay-samples", o.lr_wsd_decay_samples),
                                ("--lr-warmup-samples", o.lr_warmup_samples or None)):
                if value is not None:
                    raise ConfigError(f"{name} {value} counts samples: it needs --train-samples (or give "
                                      f"{name.replace('-samples', '-iters')})")
        if o.lr_warmup_fraction is not None and o.lr_warmup_samples:
            raise ConfigError(f"--lr-warmup-fraction {o.lr_warmup_fraction} and --lr-warmup-samples "
                              f"{o.lr_warmup_samples}: give one")
        if d.data_args_path and d.data_path:
            raise ConfigError(f"--data-args-path {d.data_args_path} holds --data-path's words: give one of the two")
        if d.per_split_data_args_path and (d.train_data_path or d.valid_data_path or d.test_data_path):
            raise ConfigError(f"--per-split-data-args-path {d.per_split_data_args_path} holds --train-data-path, "
                              "--valid-data-path and --test-data-path: give it or them")
        if d.per_split_data_args_path and (d.data_path or d.data_args_path):
            raise ConfigError(f"--per-split-data-args-path {d.per_split_data_args_path} and "
                              f"{'--data-path' if d.data_path else '--data-args-path'}: give the blend per split or "
                              "one blend cut by --split, not both")

    def _check_data(self, world_size: int) -> None:
        d = self.data
        if not d.mock_data and not d.data_path and not d.train_data_path:
            raise ValueError("no data: give --data-path PREFIX (see tools/preprocess_data.py) or --mock-data")
        if d.seq_length < 1 or d.micro_batch_size < 1:
            raise ValueError(f"--seq-length {d.seq_length} and --micro-batch-size {d.micro_batch_size} must be >= 1")
        validate_data_flags(d.data_path, d.split, d.train_data_path, d.valid_data_path, d.test_data_path)
        if d.num_workers < 0:
            raise ConfigError(f"--num-workers {d.num_workers} must be >= 0 (0 reads in the training process)")
        check_packing(self.packing)

    def _check_parallel(self, world_size: int) -> None:
        p, d, replicas = self.parallel, self.data, self.fsdp.data_parallel_replicate
        cp = p.context_parallel_size
        if self.fsdp.fsdp_cpu_offload and self.optim.optimizer_cpu_offload:
            raise ConfigError("--optimizer-cpu-offload with --fsdp-cpu-offload: FSDP's offload keeps the whole "
                              "optimizer on the host already; give one")
        if cp < 1 or world_size % (cp * replicas):
            raise ValueError(f"world size {world_size} is not divisible by --context-parallel-size {cp} x "
                             f"--data-parallel-replicate {replicas}")
        c = self.model_config()
        self.context_parallel().validate(c.num_attention_heads, c.num_query_groups, d.seq_length)
        if p.attention_kernel in ("flash_attn", "sdpa_flash") and not self.train.bf16:
            raise ConfigError(f"--attention-kernel {p.attention_kernel} takes fp16/bf16 only: add --bf16, or use "
                              "--attention-kernel auto (fp32 runs torch's memory-efficient kernel)")
        dp = world_size // cp
        if d.global_batch_size is not None and d.global_batch_size % (d.micro_batch_size * dp):
            raise ValueError(f"--global-batch-size {d.global_batch_size} is not a multiple of --micro-batch-size "
                             f"{d.micro_batch_size} x data-parallel size {dp}")

    def _check_memory(self, world_size: int) -> None:
        self.memory.check(self.model_config().num_layers)
        self.memory_stack().validate()

    def _check_model(self, world_size: int) -> None:
        m = self.model
        for name, value in (("--attention-dropout", m.attention_dropout), ("--hidden-dropout", m.hidden_dropout)):
            if value != 0:
                raise ConfigError(f"{name} {value}: training here is without dropout, as LLaMA is trained; give 0 "
                                  "(the default here)")
        if m.rotary_base is not None and m.rotary_base <= 0:
            raise ConfigError(f"--rotary-base {m.rotary_base:g} must be > 0 (rotary frequencies are base^(-2i/d); "
                              "Llama 3 uses 500000)")
        rope = self.model_config().rope_scaling
        if rope is not None and rope.rope_type == "dynamic" and self.data.reset_position_ids:
            raise ConfigError("--rope-scaling-type dynamic scales by the sample length (--seq-length), as transformers "
                              "scales by the largest position it sees; with --reset-position-ids that is the longest "
                              "document instead: drop one of them")
        if (m.max_position_embeddings is not None and m.max_position_embeddings < self.data.seq_length
                and not (rope is not None and rope.rope_type == "dynamic")):
            raise ConfigError(f"--max-position-embeddings {m.max_position_embeddings} is below --seq-length "
                              f"{self.data.seq_length}: the model's config (and its export) would claim fewer "
                              "positions than it is trained at; give at least the length, or drop the flag")
        if m.rope_scaling_factor is not None:
            if m.rope_scaling_factor <= 0:
                raise ConfigError(f"--rope-scaling-factor {m.rope_scaling_factor:g} must be > 0")
        if m.make_vocab_size_divisible_by < 1:
            raise ConfigError(f"--make-vocab-size-divisible-by {m.make_vocab_size_divisible_by} must be >= 1")
        self.model_config()  # validates the flavour and overrides

    def _check_schedule(self, world_size: int) -> None:
        o = self.optim
        if o.lr < 0 or o.min_lr < 0:
            raise ConfigError(f"--lr {o.lr} and --min-lr {o.min_lr} must be >= 0")
        if o.min_lr > o.lr:
            raise ConfigError(f"--min-lr {o.min_lr} is above --lr {o.lr}: the rate would rise while it decays")
        if o.lr_warmup_fraction is not None and (o.lr_warmup_iters or not 0 <= o.lr_warmup_fraction <= 1):
            raise ConfigError(f"--lr-warmup-fraction {o.lr_warmup_fraction}: a fraction in [0, 1], and not "
                              "together with --lr-warmup-iters")
        if o.weight_decay_incr_style == "constant":
            if o.start_weight_decay is not None or o.end_weight_decay is not None:
                raise ConfigError(f"--start-weight-decay {o.start_weight_decay} / --end-weight-decay "
                                  f"{o.end_weight_decay} need --weight-decay-incr-style linear or cosine (constant "
                                  "uses --weight-decay)")
        elif o.start_weight_decay is None or o.end_weight_decay is None:
            raise ConfigError(f"--weight-decay-incr-style {o.weight_decay_incr_style} goes from --start-weight-decay "
                              "to --end-weight-decay: give both")
        for name, value in (("--weight-decay", o.weight_decay), ("--start-weight-decay", o.start_weight_decay),
                            ("--end-weight-decay", o.end_weight_decay), ("--lr-warmup-init", o.lr_warmup_init)):
            if value is not None and value < 0:
                raise ConfigError(f"{name} {value} must be >= 0")
        if o.override_opt_param_scheduler and o.use_checkpoint_opt_param_scheduler:
            raise ConfigError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict "
                              "each other: give one")
        from megatron_lc.training.schedule import schedule_from_config

        schedule_from_config(self, world_size)  # decay, warmup and WSD iterations consistent

    def _check_run(self, world_size: int) -> None:
        t, g = self.train, self.logging
        if t.train_iters < 1:
            if t.train_samples is not None:
                raise ConfigError(f"--train-samples {t.train_samples} is less than one global batch "
                                  f"({self.global_batch(world_size)} samples): nothing to train")
            raise ConfigError(f"--train-iters {t.train_iters}: nothing to train; give at least 1")
        if g.tensorboard_log_interval < 1:
            raise ConfigError(f"--tensorboard-log-interval {g.tensorboard_log_interval} must be >= 1")
        self.profiling.check(world_size, t.train_iters)
        if self.parallel.distributed_timeout_minutes <= 0:
            raise ConfigError(f"--distributed-timeout-minutes {self.parallel.distributed_timeout_minutes} must be > 0")
        if t.skip_train and not (self.data.data_path or self.data.valid_data_path or self.data.test_data_path):
            raise ConfigError("--skip-train evaluates the validation and test parts: give --data-path (cut by --split) "
                              "or --valid-data-path / --test-data-path")
        if g.full_validation and not self.data.valid_data_path and not self.data.data_path:
            raise ConfigError("--full-validation reads the whole validation part: give --data-path (cut by --split) "
                              "or --valid-data-path")
        if g.log_interval < 1:
            raise ConfigError(f"--log-interval {g.log_interval} must be >= 1")
        if g.eval_interval is not None and (g.eval_interval < 1 or g.eval_iters < 1):
            raise ConfigError(f"--eval-interval {g.eval_interval} with --eval-iters {g.eval_iters}: both must be "
                              ">= 1 (omit --eval-interval for no validation)")
        if g.eval_interval and not self.data.valid_data_path and not self.data.data_path:
            raise ConfigError(f"--eval-interval {g.eval_interval} needs validation data: give --data-path (split "
                              "969,30,1 unless --split says otherwise) or --valid-data-path")
        for name, value in (("--exit-interval", t.exit_interval), ("--exit-duration-in-mins", t.exit_duration_in_mins),
                            ("--save-interval", self.checkpoint.save_interval),
                            ("--save-interval-minutes", self.checkpoint.save_interval_minutes)):
            if value is not None and value <= 0:
                raise ConfigError(f"{name} {value} must be > 0")
        if t.exit_signal_grace_secs is not None and (t.exit_signal_grace_secs < 0 or not t.exit_signal_handler):
            raise ConfigError(f"--exit-signal-grace-secs {t.exit_signal_grace_secs:g} is the time a signal leaves: it "
                              "must be >= 0 and needs --exit-signal-handler")
        if self.checkpoint.save_interval_minutes and not self.checkpoint.save:
            raise ConfigError(f"--save-interval-minutes {self.checkpoint.save_interval_minutes:g} saves checkpoints: "
                              "give --save DIR")

    def _check_checkpoint(self, world_size: int) -> None:
        c = self.checkpoint
        for name, on in (("--finetune", c.finetune), ("--use-checkpoint-args", c.use_checkpoint_args),
                         ("--no-load-optim", c.no_load_optim), ("--no-load-rng", c.no_load_rng),
                         ("--exit-on-missing-checkpoint", c.exit_on_missing_checkpoint),
                         ("--ckpt-step", c.ckpt_step is not None)):
            if on and not c.load:
                raise ConfigError(f"{name} reads the checkpoint in --load: give --load DIR")
        if self.data.eod_mask_loss and not self.data.tokenizer_type:
            raise ConfigError("--eod-mask-loss masks the token after each end-of-document, whose id comes from the "
                              "tokenizer: give --tokenizer-type (and --tokenizer-model)")
        if c.keep_last_checkpoints < 0:
            raise ConfigError(f"--keep-last-checkpoints {c.keep_last_checkpoints}: 0 keeps all, N > 0 the newest N")

    def _check_megatron_flags(self, world_size: int) -> None:
        """Megatron-LM flags of parallelisms this framework replaces: refused, saying what it does instead."""
        p = self.parallel
        instead = ("FSDP2 + context parallelism shard parameters, gradients, optimizer state and the sequence "
                   "over all ranks instead")
        if p.tensor_model_parallel_size != 1:
            raise ConfigError(f"--tensor-model-parallel-size {p.tensor_model_parallel_size}: no tensor parallelism "
                              f"here; {instead} (drop the flag, or give 1)")
        if p.pipeline_model_parallel_size != 1:
            raise ConfigError(f"--pipeline-model-parallel-size {p.pipeline_model_parallel_size}: no pipeline "
                              f"parallelism here; {instead} (drop the flag, or give 1)")
        if p.sequence_parallel:
            raise ConfigError("--sequence-parallel: Megatron's sequence parallelism belongs to tensor parallelism, "
                              "which is not here; --context-parallel-size N splits the sequence over N ranks instead")
        if self.fsdp.use_distributed_optimizer:
            raise ConfigError("--use-distributed-optimizer: FSDP2 + context parallelism shard the optimizer state "
                              "over all ranks already, always; drop the flag")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
