"""The training room's flag sections: the optimizer and its schedule, the run, checkpoints, logging and
evaluation (a leaf module: `config` composes these sections with the other rooms')."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lc.flags import flag


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
    exit_duration_in_mins: float | None = flag(None, "save and exit 3 (resume me) before the first step that could "
                                               "not finish and save within this many minutes of the start "
                                               "(Slurm's own time limit is read too)")
    exit_signal_handler: bool = flag(False, "on SIGTERM or SIGUSR1 (preemption, scancel, a time limit with "
                                     "--signal), save at the next step boundary on every rank and exit 3 (resume me)")
    exit_signal_grace_secs: float | None = flag(None, "with --exit-signal-handler: the seconds the scheduler leaves between "
                                         "its signal and SIGKILL (default 30, torchrun's and Slurm's); a signal "
                                         "inside a step that cannot finish and save within them stops the run at "
                                         "once (exit 3), to resume from the last checkpoint")


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
    save_interval_minutes: float | None = flag(None, "also save at the first step boundary once this many minutes "
                                               "have passed since the last save (or the start)")
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
    memory_plan: str | None = flag(None, "the planner's estimate of this run (tools/estimate_memory.py with the "
                                   "same flags and --json > FILE): each step's peak is logged beside its "
                                   "prediction, and its step time judges the deadline before a step is measured")
    log_validation_ppl_to_tensorboard: bool = flag(False, "also write the validation perplexity to tensorboard "
                                                   "('lm loss validation ppl')")
