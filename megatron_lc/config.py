"""One dataclass tree for a training run; Megatron-style CLI flags derived from it.

Every field becomes a flag named as in Megatron-LM (`seq_length` -> `--seq-length`), with
the field's `help` as its help text. `--config FILE.yaml|.toml` loads a preset (keys are
field names, flat or grouped by section); flags on the command line win over the preset.
`TrainConfig.validate(world_size)` rejects impossible combinations before any process
group or accelerator memory is touched, naming the flag and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_type_hints

import torch

from megatron_lc.errors import ConfigError
from megatron_lc.cli import ArgumentParser
from megatron_lc.attention.context_parallel import CP_IMPLS, ContextParallel
from megatron_lc.attention.ring import RING_KV_GRADS
from megatron_lc.attention.untied_ulysses import BACKWARD_MEMORY
from megatron_lc.data.sources import validate_data_flags
from megatron_lc.attention.rotary import ROPE_TYPES
from megatron_lc.data.tokenizers import TOKENIZER_TYPES
from megatron_lc.flags import flag, flag_list
from megatron_lc.memory.stack import OFFLOAD_ALIASES, MemoryArgs, MemoryStack, fold_offload_aliases


@dataclass
class ModelArgs:
    model: str = flag("debug", "model flavour from the zoo (python -m megatron_lc.models --list)")
    num_layers: int | None = flag(None, "override: transformer blocks")
    hidden_size: int | None = flag(None, "override: width of the residual stream")
    ffn_hidden_size: int | None = flag(None, "override: width of the SwiGLU MLP")
    num_attention_heads: int | None = flag(None, "override: query heads")
    num_query_groups: int | None = flag(None, "override: key/value heads (GQA)")
    kv_channels: int | None = flag(None, "override: head dimension")
    vocab_size: int | None = flag(None, "override: vocabulary size (default: the tokenizer's, else the flavour's); "
                                        "with --tokenizer-type NullTokenizer the tokenizer's N (EOD = N, "
                                        "vocabulary N + 1)")
    rotary_base: float | None = flag(None, "override: rotary theta")
    norm_epsilon: float | None = flag(None, "override: RMSNorm epsilon")
    max_position_embeddings: int | None = flag(None, "override: positions recorded in exported configs (rotary "
                                               "itself works at any length)")
    untie_embeddings_and_output_weights: bool = flag(False, "an output matrix of its own for a flavour that ties it "
                                                     "to the embedding")
    init_method_std: float | None = flag(None, "override: standard deviation of the normal initialisation")
    use_rope_scaling: bool = flag(False, "Llama 3.x rotary scaling (factor --rope-scaling-factor, default 8)")
    rope_scaling_factor: float | None = flag(None, "rotary scaling factor (with --use-rope-scaling, or for a flavour "
                                                   "or checkpoint that scales)")
    rope_scaling_type: str | None = flag(None, "rotary scaling as transformers names it: llama3 (Llama 3.x, the "
                                         "default), linear (position interpolation), yarn (NTK-by-parts with its "
                                         "attention factor) or dynamic (NTK, the base raised by --seq-length over "
                                         "--max-position-embeddings)", choices=ROPE_TYPES)
    rope_scaling_original_max_position_embeddings: int | None = flag(
        None, "the context the base model was trained at, which the scaling stretches (default 8192, or the "
        "checkpoint's)")
    rope_scaling_low_freq_factor: float | None = flag(None, "llama3 scaling: low_freq_factor (default 1)")
    rope_scaling_high_freq_factor: float | None = flag(None, "llama3 scaling: high_freq_factor (default 4)")
    rope_scaling_beta_fast: float | None = flag(None, "yarn scaling: beta_fast (default 32)")
    rope_scaling_beta_slow: float | None = flag(None, "yarn scaling: beta_slow (default 1)")
    rope_scaling_attention_factor: float | None = flag(None, "yarn scaling: the factor on cos and sin (default "
                                                       "0.1 ln(factor) + 1)")
    make_vocab_size_divisible_by: int = flag(1, "pad the vocabulary (the tokenizer's, --vocab-size or the "
                                             "flavour's) up to a multiple of this, as Megatron-LM: the pad rows "
                                             "are embedding and output rows no token uses (Megatron-LM's default "
                                             "is 128; 1 leaves it as it is)")
    attention_dropout: float = flag(0.0, "dropout on the attention probabilities: only 0 (LLaMA trains without "
                                         "dropout; Megatron-LM's default is 0.1)")
    hidden_dropout: float = flag(0.0, "dropout on the residual branches: only 0 (LLaMA trains without dropout; "
                                      "Megatron-LM's default is 0.1)")
    checkpoint_model: dict | None = field(default=None, metadata={
        "cli": False, "help": "the whole model config of the checkpoint in --load (--use-checkpoint-args)"})


@dataclass
class ParallelArgs:
    context_parallel_size: int = flag(1, "context-parallel degree: each sequence is split over this many ranks")
    cp_impl: str = flag("ulysses", "context-parallel attention of the all-to-all level", choices=CP_IMPLS)
    cp_comm_type: str = flag("a2a", "context-parallel communication: a2a (all-to-all, --cp-impl), p2p (ring "
                             "attention over the cp group), a2a+p2p (all-to-all inside groups of contiguous ranks, "
                             "a ring across them; see --hierarchical-context-parallel-sizes)",
                             choices=("a2a", "p2p", "a2a+p2p"))
    hierarchical_context_parallel_sizes: list[int] = flag_list(
        "with --cp-comm-type a2a+p2p: A R, the all-to-all degree (contiguous ranks: a node) and the ring degree; "
        "A x R = --context-parallel-size")
    untied_heads_per_stage: int | None = flag(None, "Untied Ulysses heads per stage (a multiple of the all-to-all "
                                              "degree; default that degree)")
    untied_overlap_stages: bool = flag(False, "Untied Ulysses: the next stage's projections and all-to-alls in "
                                       "flight while a stage attends, forward and backward (one more set of "
                                       "stage buffers)")
    untied_backward: str = flag("fast", "what Untied Ulysses' backward holds: fast (a kv round's dK/dV summed over "
                                "its stages in fp32 and sent back once; the attention output kept whole) or lean "
                                "(each stage's dK/dV sent back with its dQ, no fp32 sums; the output kept by stage "
                                "and each stage's freed once sent: less memory at the backward's peak, more bytes "
                                "exchanged)", choices=BACKWARD_MEMORY)
    ring_kv_grads: str = flag("overlapped", "ring attention's backward: overlapped (the fp32 dK/dV accumulators travel "
                              "while the next block attends: two pairs held, the kernels' shares kept until one "
                              "arrives) or in_place (rotated in place after each step through a small staging "
                              "buffer, the shares added as made: one pair held, the rotation not hidden)",
                              choices=RING_KV_GRADS)
    data_parallel_replicate: int = flag(1, "HSDP replicas (outer data-parallel dimension); the rest is sharded")
    attention_kernel: str = flag("auto", "local attention kernel",
                                 choices=("auto", "flash_attn", "sdpa_flash", "sdpa_efficient", "cpu_flash",
                                          "reference"))
    flash_attention_impl: str = flag("auto", "what runs torch's flash kernels, through torch's registry "
                                     "(torch.nn.attention.activate_flash_attention_impl): auto (FA3 on compute "
                                     "capability 9.0 when flash_attn_interface imports, FA4 on 10.0 when "
                                     "flash_attn.cute imports, else torch's own), default, fa3, fa4",
                                     choices=("auto", "default", "fa3", "fa4"))
    distributed_timeout_minutes: int = flag(10, "timeout of the process group's collectives, in minutes "
                                                "(init_process_group's timeout, as Megatron-LM)")
    fsdp_cpu_offload: bool = flag(False, "keep sharded parameters, gradients and optimizer state in host memory")
    no_reshard_after_forward: bool = flag(False, "keep gathered parameters between forward and backward")
    tensor_model_parallel_size: int = flag(1, "Megatron-LM's tensor parallelism: only 1 (FSDP2 + context "
                                           "parallelism shard the model and the sequence instead)")
    pipeline_model_parallel_size: int = flag(1, "Megatron-LM's pipeline parallelism: only 1 (FSDP2 shards the "
                                             "layers' parameters instead)")
    sequence_parallel: bool = flag(False, "Megatron-LM's sequence parallelism (of tensor parallelism): refused; "
                                   "--context-parallel-size splits the sequence instead")
    use_distributed_optimizer: bool = flag(False, "Megatron-LM's sharded optimizer: refused, as FSDP2 always shards "
                                           "the optimizer state (drop the flag)")


@dataclass
class DataArgs:
    data_path: list[str] = flag_list("indexed datasets: PREFIX ... or W1 PREFIX1 W2 PREFIX2 ... (weighted blend; "
                                     "PREFIX of PREFIX.bin/.idx); cut into train/valid/test by --split")
    split: str | None = flag(None, "train,valid,test weights carving every --data-path prefix by document, "
                                   "e.g. 969,30,1 (default with --data-path: 969, 30, 1 and a warning, as "
                                   "Megatron-LM)")
    data_args_path: str | None = flag(None, "a file holding --data-path's words (whitespace-separated: PREFIX ... "
                                            "or W1 PREFIX1 ...), for blends too long for a command line")
    per_split_data_args_path: str | None = flag(None, "a JSON file {\"train\": ..., \"valid\": ..., \"test\": "
                                                      "...}, each a string or list of --train-data-path's words "
                                                      "(valid and test may be null)")
    train_data_path: list[str] = flag_list("training blend, uncut (replaces --data-path's train part)")
    valid_data_path: list[str] = flag_list("validation blend, uncut (replaces --data-path's valid part)")
    test_data_path: list[str] = flag_list("test blend, uncut (replaces --data-path's test part)")
    data_cache_path: str | None = flag(None, "directory for built sample indices (epoch layouts, blending "
                                             "indices), reused when data and flags are the same")
    mock_data: bool = flag(False, "deterministic random tokens instead of --data-path")
    tokenizer_type: str | None = flag(None, "tokenizer of the data (for vocab size and generation)",
                                      choices=TOKENIZER_TYPES)
    tokenizer_model: str | None = flag(None, "tokenizer file or directory")
    vocab_file: str | None = flag(None, "GPT2BPETokenizer: its vocab.json")
    merge_file: str | None = flag(None, "GPT2BPETokenizer: its merges.txt")
    seq_length: int = flag(1024, "tokens per sample")
    micro_batch_size: int = flag(1, "samples per rank per forward/backward")
    global_batch_size: int | None = flag(None, "samples per step over all data-parallel ranks "
                                               "(default micro x dp; more means gradient accumulation)")
    no_shuffle: bool = flag(False, "read documents in stream order")
    num_workers: int = flag(0, "worker processes reading micro-batches ahead of the step (torch DataLoader "
                               "workers, as Megatron-LM; 0 reads them in the training process; Megatron-LM's "
                               "default is 2)")
    reset_position_ids: bool = flag(False, "restart positions at each document")
    reset_attention_mask: bool = flag(False, "attend within each document only (default: a sample attends "
                                             "across its end-of-document tokens as one sequence, as Megatron-LM)")
    eod_mask_loss: bool = flag(False, "do not train on predicting the token after an end-of-document")


@dataclass
class OptimArgs:
    lr: float = flag(3e-4, "peak learning rate")
    min_lr: float = flag(3e-5, "learning rate at the end of the decay (and the floor of inverse-square-root)")
    lr_decay_style: str = flag("cosine", "learning-rate decay after warmup",
                               choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    lr_decay_iters: int | None = flag(None, "steps over which the rate decays to --min-lr (default --train-iters)")
    lr_warmup_iters: int = flag(0, "linear warmup steps")
    lr_warmup_fraction: float | None = flag(None, "warmup as a fraction of --lr-decay-iters or --lr-decay-samples "
                                            "(instead of --lr-warmup-iters or --lr-warmup-samples)")
    lr_warmup_init: float = flag(0.0, "the rate warmup starts from (rising linearly to --lr)")
    lr_decay_samples: int | None = flag(None, "with --train-samples: samples over which the rate decays to --min-lr "
                                        "(default --train-samples)")
    lr_warmup_samples: int = flag(0, "with --train-samples: samples of linear warmup")
    lr_wsd_decay_samples: int | None = flag(None, "with --train-samples and WSD: samples of the final decay")
    lr_wsd_decay_iters: int | None = flag(None, "WSD: steps of the final decay (the rate is constant before)")
    lr_wsd_decay_style: str = flag("linear", "WSD: shape of the final decay", choices=("linear", "cosine"))
    override_opt_param_scheduler: bool = flag(False, "on resume, take the learning-rate schedule from the command "
                                              "line, not the checkpoint", flag_name="--override-opt_param-scheduler")
    use_checkpoint_opt_param_scheduler: bool = flag(False, "on resume, take the learning-rate schedule from the "
                                                    "checkpoint, whatever the command line says",
                                                    flag_name="--use-checkpoint-opt_param-scheduler")
    weight_decay: float = flag(0.1, "AdamW weight decay (with --weight-decay-incr-style constant)")
    start_weight_decay: float | None = flag(None, "weight decay at step 1 (with --weight-decay-incr-style linear or "
                                            "cosine)")
    end_weight_decay: float | None = flag(None, "weight decay at the end of training (with "
                                          "--weight-decay-incr-style linear or cosine)")
    weight_decay_incr_style: str = flag("constant", "how the weight decay goes from --start-weight-decay to "
                                        "--end-weight-decay over training", choices=("constant", "linear", "cosine"))
    adam_beta1: float = flag(0.9, "AdamW beta1")
    adam_beta2: float = flag(0.95, "AdamW beta2")
    adam_eps: float = flag(1e-8, "AdamW epsilon")
    clip_grad: float = flag(1.0, "clip gradients to this global L2 norm (0: off)")
    optimizer_cpu_offload: bool = flag(False, "fp32 master weights, Adam moments and gradients in host memory, the "
                                       "optimizer step on the host (training/optim.py HostAdamW)")


@dataclass
class TrainArgs:
    train_iters: int | None = flag(None, "optimizer steps (default 10, or --train-samples // global batch)")
    train_samples: int | None = flag(None, "samples to train on, instead of --train-iters: --train-samples // "
                                     "--global-batch-size steps, the schedule counted in samples (--lr-*-samples)")
    skip_train: bool = flag(False, "no training: load --load, evaluate the validation and test parts, exit")
    bf16: bool = flag(False, "bf16 compute with fp32 master weights and fp32 gradient reduction (fp32 without it)")
    device: str = flag("auto", "accelerator", choices=("auto", "cuda", "cpu"))
    seed: int = flag(1234, "seed of weights and data order")
    skip_nonfinite: bool = flag(False, "skip a step whose loss or gradient is NaN/Inf instead of stopping")
    exit_interval: int | None = flag(None, "exit after the step divisible by N (after saving), e.g. to fit a job limit")
    exit_duration_in_mins: float | None = flag(None, "save and exit 0 at the first step boundary after this many "
                                               "minutes of training")
    exit_signal_handler: bool = flag(False, "on SIGTERM or SIGUSR1 (preemption, scancel, a time limit with "
                                     "--signal), save at the next step boundary on every rank and exit 0")


@dataclass
class CheckpointArgs:
    save: str | None = flag(None, "directory to save checkpoints into")
    load: str | None = flag(None, "directory to resume from (newest intact checkpoint; empty or missing: start "
                               "from scratch)")
    override_data_settings: bool = flag(False, "on resume, continue although the data differs from the "
                                        "checkpoint's (other datasets, weights, --split, --seed, ...): the "
                                        "optimizer, step and data position are kept (a new --seq-length or batch "
                                        "needs no flag: the token stream continues where it stopped)")
    finetune: bool = flag(False, "load only the weights from --load and start at step 0 (new optimizer, schedule, "
                          "data position)")
    no_load_optim: bool = flag(False, "on resume, do not load the optimizer state")
    no_load_rng: bool = flag(False, "on resume, do not load the random-number generator state")
    no_save_optim: bool = flag(False, "save checkpoints without the optimizer state (a resume from one starts a "
                               "fresh optimizer, as --no-load-optim)")
    no_save_rng: bool = flag(False, "save checkpoints without the random-number generator state (a resume from one "
                             "does not restore it, as --no-load-rng)")
    exit_on_missing_checkpoint: bool = flag(False, "with --load: stop (exit status 2) instead of starting from "
                                            "scratch when it holds no checkpoint")
    ckpt_step: int | None = flag(None, "load the checkpoint of this step from --load (iter_N), not the newest")
    use_checkpoint_args: bool = flag(False, "take the model's shape (--num-layers, --hidden-size, ...) from the "
                                     "checkpoint in --load")
    save_interval: int | None = flag(None, "save every N steps (and at the end)")
    keep_last_checkpoints: int = flag(0, "0 keeps every checkpoint in --save (as Megatron-LM); N > 0 keeps the "
                                      "newest N and deletes the older ones")


@dataclass
class LoggingArgs:
    log_interval: int = flag(1, "steps between log lines")
    log_dir: str | None = flag(None, "where metrics.jsonl goes (default: a new directory under runs/)")
    tensorboard_dir: str | None = flag(None, "tensorboard event files (default: none)")
    tensorboard_log_interval: int = flag(1, "steps between tensorboard (and wandb) records")
    log_throughput: bool = flag(False, "put Megatron-LM's throughput per GPU (TFLOP/s/GPU) on the console line")
    log_params_norm: bool = flag(False, "compute the L2 norm of all parameters at each logged step (console "
                                 "'params norm', tensorboard 'params-norm')")
    eval_interval: int | None = flag(None, "validation every N steps")
    full_validation: bool = flag(False, "each evaluation reads the whole validation part once (instead of "
                                 "--eval-iters batches)")
    eval_iters: int = flag(2, "global batches per evaluation (Megatron's iterations); the test part, when there is one, "
                                 "is evaluated once at the end of training over as many")
    wandb_project: str | None = flag(None, "Weights & Biases project to log to (needs the wandb package)")
    wandb_exp_name: str | None = flag(None, "Weights & Biases run name")
    log_validation_ppl_to_tensorboard: bool = flag(False, "also write the validation perplexity to tensorboard "
                                                   "('lm loss validation ppl')")


SECTIONS = {
    "model": ModelArgs, "parallel": ParallelArgs, "memory": MemoryArgs, "data": DataArgs,
    "optim": OptimArgs, "train": TrainArgs, "checkpoint": CheckpointArgs, "logging": LoggingArgs,
}


@dataclass
class TrainConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    memory: MemoryArgs = field(default_factory=MemoryArgs)
    data: DataArgs = field(default_factory=DataArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)

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
        config = self._unpadded_model_config(vocab_size)
        multiple = self.model.make_vocab_size_divisible_by
        if not padded or multiple <= 1 or config.vocab_size % multiple == 0:
            return config
        return dataclasses.replace(config, vocab_size=padded_vocab_size(config.vocab_size, multiple))

    def _unpadded_model_config(self, vocab_size: int | None):
        from megatron_lc.models.llama import FLAVOURS, get_config
        from megatron_lc.models.llama.zoo import config_from_dict, rope_scaling_from_flags

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
        from megatron_lc.memory.chunks import plan_chunks

        c = self.model_config()
        local_tokens = self.data.micro_batch_size * self.data.seq_length // self.parallel.context_parallel_size
        chunks = plan_chunks(local_tokens, c.hidden_size, c.ffn_hidden_size, c.vocab_size, 2 if self.train.bf16 else 4,
                             mlp_tiles=self.memory.tiled_mlp_tiles, loss_tiles=self.memory.tiled_loss_tiles)
        return self.memory.stack(c.num_layers, chunks)

    def context_parallel(self) -> ContextParallel:
        """The run's context-parallel attention (`attention.context_parallel`)."""
        p = self.parallel
        return ContextParallel(layout=self.context_layout(), impl=p.cp_impl, heads_per_stage=p.untied_heads_per_stage,
                               overlap=p.untied_overlap_stages, untied_backward=p.untied_backward,
                               ring_kv_grads=p.ring_kv_grads, kernel=p.attention_kernel,
                               flash_impl=p.flash_attention_impl)

    def parallelize_options(self):
        """The ParallelizeOptions of the run: its context parallelism, memory stack and FSDP settings."""
        from megatron_lc.models.llama.parallelize import FSDPSettings, ParallelizeOptions

        par = self.parallel
        fsdp = FSDPSettings(param_dtype=torch.bfloat16 if self.train.bf16 else torch.float32,
                            reduce_dtype=torch.float32, reshard_after_forward=not par.no_reshard_after_forward,
                            cpu_offload=par.fsdp_cpu_offload)
        return ParallelizeOptions(cp=self.context_parallel(), memory=self.memory_stack(), fsdp=fsdp,
                                  seq_length=self.data.seq_length)

    def parallel_dims(self, world_size: int):
        """The run's parallel degrees on `world_size` ranks (`parallel_state.ParallelDims`)."""
        from megatron_lc.parallel_state import ParallelDims

        p = self.parallel
        return ParallelDims(world_size, cp=p.context_parallel_size, dp_replicate=p.data_parallel_replicate,
                            cp_ring=self.context_layout().ring_size)

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
        return context_layout_from_flags(p.context_parallel_size, p.cp_comm_type,
                                         p.hierarchical_context_parallel_sizes)

    def attention_call(self):
        """The largest attention kernel call of this run (`attention.kernels.AttentionCall`): a micro-batch's
        sequences, whole after the all-to-all, a ring's share with one; one document per sample (with
        --reset-attention-mask, the documents of a sample are not known before the data: one is assumed)."""
        import torch

        from megatron_lc.attention.kernels import AttentionCall

        c = self.model_config()
        return AttentionCall(self.data.micro_batch_size * self.data.seq_length // self.context_layout().ring_size,
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

    def _check_parallel(self, world_size: int) -> None:
        p, d = self.parallel, self.data
        cp = p.context_parallel_size
        if p.fsdp_cpu_offload and self.optim.optimizer_cpu_offload:
            raise ConfigError("--optimizer-cpu-offload with --fsdp-cpu-offload: FSDP's offload keeps the whole "
                              "optimizer on the host already; give one")
        if cp < 1 or world_size % (cp * p.data_parallel_replicate):
            raise ValueError(f"world size {world_size} is not divisible by --context-parallel-size {cp} x "
                             f"--data-parallel-replicate {p.data_parallel_replicate}")
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
                            ("--save-interval", self.checkpoint.save_interval)):
            if value is not None and value <= 0:
                raise ConfigError(f"{name} {value} must be > 0")

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
        if p.use_distributed_optimizer:
            raise ConfigError("--use-distributed-optimizer: FSDP2 + context parallelism shard the optimizer state "
                              "over all ranks already, always; drop the flag")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """The vocabulary rounded up to a multiple of `multiple` (Megatron-LM's _vocab_size_with_padding, one
    tensor-parallel rank)."""
    return -(-vocab_size // multiple) * multiple


def _read_text(path: str, flag_name: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{flag_name} {path}: cannot be read ({e.strerror or e})") from e


def read_data_args(path: str) -> list[str]:
    """--data-args-path: the file's whitespace-separated words are --data-path's (Megatron-LM's format)."""
    words = _read_text(path, "--data-args-path").split()
    if not words:
        raise ConfigError(f"--data-args-path {path}: the file is empty; it holds --data-path's words")
    return words


def read_per_split_data_args(path: str) -> dict[str, list[str]]:
    """--per-split-data-args-path: Megatron-LM's JSON object with keys train, valid and test, each a string of
    whitespace-separated words or a list of them (a blend as --train-data-path takes it); null: none."""
    import json

    try:
        data = json.loads(_read_text(path, "--per-split-data-args-path"))
    except ValueError as e:
        raise ConfigError(f"--per-split-data-args-path {path}: not valid JSON ({e})") from e
    if not isinstance(data, dict) or "train" not in data or set(data) - {"train", "valid", "test"}:
        raise ConfigError(f"--per-split-data-args-path {path}: expected an object with keys train, valid, test "
                          f"(got {sorted(data) if isinstance(data, dict) else type(data).__name__})")
    parts = {}
    for key in ("train", "valid", "test"):
        value = data.get(key)
        if value is None:
            parts[key] = []
        elif isinstance(value, str):
            parts[key] = value.split()
        elif isinstance(value, list) and all(isinstance(w, (str, int, float)) for w in value):
            parts[key] = [str(w) for w in value]
        else:
            raise ConfigError(f"--per-split-data-args-path {path}: {key} must be a string or a list of words, got "
                              f"{value!r}")
    if not parts["train"]:
        raise ConfigError(f"--per-split-data-args-path {path}: train is empty")
    return parts


# --- command line ---------------------------------------------------------------------


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_field(group, f: dataclasses.Field, hint) -> None:
    meta = dict(f.metadata)
    help_text = meta.pop("help", "")
    names = [_flag_name(f.name)]
    if "flag_name" in meta:  # Megatron's spelling first, the plain hyphenated one as an alias
        names.insert(0, meta.pop("flag_name"))
    default = f.default if f.default is not dataclasses.MISSING else None
    if hint is bool:
        group.add_argument(*names, dest=f.name, action="store_true", default=None, help=help_text)
        return
    kind = _scalar_type(hint)
    group.add_argument(*names, dest=f.name, type=kind, default=None,
                       help=f"{help_text} (default: {default})", **meta)


def _scalar_type(hint):
    """int | None -> int, list[str] -> str, ..."""
    args = [a for a in getattr(hint, "__args__", ()) if a is not type(None)]
    return args[0] if args else hint


def build_parser(exit_on_error: bool = True) -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m megatron_lc.train", exit_on_error=exit_on_error,
                                     description="Train a LLaMA model on long contexts.")
    parser.add_argument("--config", default=None, help="YAML or TOML preset; command-line flags win")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli", True):  # a field set by the program (from a checkpoint), not a flag
                _add_field(group, f, hints[f.name])
    for alias in OFFLOAD_ALIASES:  # old spellings of --offload-mode, folded by config_from_values
        parser.add_argument(_flag_name(alias), dest=alias, action="store_true", default=None, help=argparse.SUPPRESS)
    return parser


def _read_preset(path: str) -> dict:
    """The preset's settings by field name (flat, or grouped by section)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot be read ({e.strerror or e})") from e
    if not path.endswith((".yaml", ".yml", ".toml")):
        raise ConfigError(f"--config {path}: expected a .yaml, .yml or .toml file")
    try:
        data = _parse_preset_text(path, text)
    except ValueError as e:  # yaml.YAMLError and tomllib.TOMLDecodeError are ValueErrors or wrapped as one
        raise ConfigError(f"--config {path}: not valid {'TOML' if path.endswith('.toml') else 'YAML'} ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected settings by name at the top level, got a {type(data).__name__}")
    flat = {}
    for key, value in data.items():  # grouped by section or flat
        flat.update(value if key in SECTIONS and isinstance(value, dict) else {key: value})
    return flat


def _parse_preset_text(path: str, text: str):
    if path.endswith(".toml"):
        import tomllib

        return tomllib.loads(text)
    import yaml

    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ValueError(str(e).replace("\n", " ")) from e


def _preset_argv(path: str, values: dict, parser: argparse.ArgumentParser) -> list[str]:
    """The preset as command-line words, so it is typed and checked exactly like flags."""
    flags = {a.dest: a for a in parser._actions}  # argparse keeps its actions only here
    argv = []
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in flags or name == "config":
            raise ConfigError(f"--config {path}: unknown setting {key!r}")
        action = flags[name]
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ConfigError(f"--config {path}: {key} must be true or false, got {value!r}")
            argv += [action.option_strings[0]] if value else []
        elif value is not None:
            words = value if isinstance(value, list) else [value]
            argv += [action.option_strings[0], *(str(w) for w in words)]
    return argv


def _parse_preset(path: str) -> dict:
    """The preset's values, parsed by the flags' own parser; errors name the file."""
    parser = build_parser(exit_on_error=False)
    argv = _preset_argv(path, _read_preset(path), parser)
    try:
        parsed, extra = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(f"--config {path}: {e}") from e
    if extra:
        raise ConfigError(f"--config {path}: {' '.join(extra)} left over: a list given to a setting that takes "
                          "one value")
    parsed = vars(parsed)
    return {k: v for k, v in parsed.items() if v is not None and k != "config"}


def config_from_values(values: dict) -> TrainConfig:
    """A TrainConfig from field-name -> value (unknown names are refused, naming them)."""
    cfg = TrainConfig()
    values = fold_offload_aliases({k.replace("-", "_"): v for k, v in values.items()})
    known = {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    for name, value in values.items():
        name = name.replace("-", "_")
        if name not in known:
            raise ValueError(f"unknown setting {name!r}")
        if value is not None:
            setattr(getattr(cfg, known[name]), name, value)
    return cfg


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """TrainConfig from the command line (and the --config preset)."""
    args = vars(build_parser().parse_args(argv))
    path = args.pop("config")
    preset = _parse_preset(path) if path else {}
    values = {**preset, **{k: v for k, v in args.items() if v is not None}}
    return config_from_values(values)
