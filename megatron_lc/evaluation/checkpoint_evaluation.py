"""A checkpoint evaluated: its loss on a dataset in stream order (optionally by position in the context), or the
passkey test (`passkey.py`). The command line is `python -m megatron_lc.evaluate` (`megatron_lc/evaluate.py`, whose
parser builds the `args` read here); it starts its processes as training does (`training.startup`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lc.errors import ConfigError
from megatron_lc.arguments import config_from_values
from megatron_lc.data.loader import MicroBatchLoader
from megatron_lc.data.samples import SampleSource
from megatron_lc.data.packing import PackingSpec
from megatron_lc.data.sources import SPLIT_NAMES, build_datasets
from megatron_lc.evaluation.passkey import DEFAULT_DEPTHS, passkey_table, plot_passkey, run_passkey
from megatron_lc.training.hf_conversion import config_from_meta
from megatron_lc.training.build import build_sharded_model
from megatron_lc.training.preflight import preflight
from megatron_lc.training.startup import start_processes
from megatron_lc.parallel_state import require_launcher
from megatron_lc.training import checkpointing
from megatron_lc.training.step import IGNORE_INDEX


def evaluate(args) -> dict:
    launch = require_launcher()
    found = checkpointing.newest_intact_checkpoint(args.load)
    if found is None:
        raise ConfigError(f"--load {args.load}: no intact checkpoint there "
                          f"({checkpointing.missing_checkpoint_hint(args.load)})")
    path, meta = found
    config = config_from_meta(meta)
    trained = meta.get("train_config", {}).get("data", {})
    for name in ("reset_position_ids", "reset_attention_mask"):  # the contexts training saw, unless told
        if getattr(args, name) is None:
            setattr(args, name, bool(trained.get(name, False)))
    packed = meta.get("train_config", {}).get("packing", {})  # the samples training cut, unless told
    args.packing = args.packing or packed.get("packing", "stream")
    args.long_documents = args.long_documents or packed.get("long_documents", "stop")
    if args.packing == "documents":
        args.reset_attention_mask = True  # each document attends to itself
    if not args.data_path and not args.passkey:
        raise ConfigError("give --data-path (the loss on a dataset) or --passkey (the passkey test)")
    tokenizer = _passkey_tokenizer(args, meta) if args.passkey else None
    _refuse_flags_that_would_not_act(args)
    args.passkey_depths = args.passkey_depths or list(DEFAULT_DEPTHS)
    args.passkey_trials = 5 if args.passkey_trials is None else args.passkey_trials
    args.loss_by_position_in = args.loss_by_position_in or "context"
    lengths = args.passkey_lengths or [args.seq_length]
    if args.passkey and (args.passkey_trials < 1 or not all(0 <= d <= 1 for d in args.passkey_depths)):
        raise ConfigError(f"--passkey-trials {args.passkey_trials} must be >= 1 and --passkey-depths "
                          f"{args.passkey_depths} between 0 and 1")
    if args.loss_by_position is not None and not 1 <= args.loss_by_position <= args.seq_length:
        raise ConfigError(f"--loss-by-position {args.loss_by_position}: between 1 and --seq-length "
                          f"{args.seq_length} buckets (each holds at least one position)")
    cfg = config_from_values({"context_parallel_size": args.context_parallel_size, "cp_impl": args.cp_impl,
                              "data_parallel_replicate": args.data_parallel_replicate,
                              "cp_comm_type": args.cp_comm_type,
                              # samples in stream order, loss by position in the sample: the sequence's cut
                              "cp_document_layout": "sequence",
                              "hierarchical_context_parallel_sizes": args.hierarchical_context_parallel_sizes or [],
                              "seq_length": args.seq_length, "data_path": args.data_path or [],
                              "mock_data": args.passkey, "split": args.split, "device": args.device,
                              "packing": "stream" if args.passkey else args.packing,
                              "long_documents": "stop" if args.passkey else args.long_documents})
    cfg.validate(launch.world_size)
    for length in lengths if args.passkey else ():
        try:
            cfg.context_layout().check(length)
        except ValueError as e:
            raise ConfigError(f"--passkey-lengths: {e}") from None
    preflight(cfg)
    source = None if args.passkey and not args.data_path else evaluation_source(args, config.vocab_size)
    total = 0 if args.passkey else min(args.num_samples or len(source), len(source))
    spec = cfg.run_spec(launch.world_size, model=config)
    per_step = args.micro_batch_size * spec.dims.dp
    if not args.passkey and total < per_step:
        raise ConfigError(f"--data-path {' '.join(args.data_path)} holds {len(source)} whole samples of --seq-length "
                          f"{args.seq_length}; evaluating needs at least {per_step} (shorten --seq-length)")
    devices, pstate = start_processes(cfg, spec.dims, launch, say_nccl_settings=False)  # as training starts; stdout is JSON
    layout = cfg.context_layout()
    model, _ = build_sharded_model(cfg, spec, pstate, devices)
    checkpointing.load_model_weights(path, model)
    model.eval()
    if args.passkey:
        haystack = None if source is None else (lambda n: source.read_tokens(0, 0, n).astype("int64"))
        result = run_passkey(model, tokenizer, pstate, devices.accelerator, lengths, args.passkey_depths,
                             args.passkey_trials, haystack=haystack)
        if launch.rank == 0:
            print(passkey_table(result), flush=True)
            if args.passkey_plot:
                plot_passkey(result, args.passkey_plot)
        return result
    loader = MicroBatchLoader(source, args.micro_batch_size, pstate.dp_rank, pstate.dp_size, pstate.cp_rank,
                              pstate.cp_size, reset_position_ids=args.reset_position_ids,
                              reset_attention_mask=args.reset_attention_mask, num_samples=total - total % per_step,
                              cp_ring=layout.ring_size)
    return _loss_over(loader, model, pstate, devices.accelerator, args)


def _refuse_flags_that_would_not_act(args) -> None:
    """A flag of the other evaluation (the passkey test, or the dataset's loss by position) is refused, naming it."""
    passkey_only = {"--passkey-depths": args.passkey_depths, "--passkey-trials": args.passkey_trials,
                    "--passkey-lengths": args.passkey_lengths, "--passkey-plot": args.passkey_plot,
                    "--tokenizer-type": args.tokenizer_type, "--tokenizer-model": args.tokenizer_model}
    for name, value in passkey_only.items():
        if value is not None and not args.passkey:
            raise ConfigError(f"{name} sets the passkey test: add --passkey")
    if args.passkey and args.loss_by_position is not None:
        raise ConfigError("--loss-by-position is the dataset's loss by position, not the passkey test's: drop one")
    if args.loss_by_position_in is not None and args.loss_by_position is None:
        raise ConfigError(f"--loss-by-position-in {args.loss_by_position_in} chooses the buckets of "
                          "--loss-by-position: add it")


def _passkey_tokenizer(args, meta: dict):
    """The tokenizer the passkey's text is written in: the flags', else the one the checkpoint trained with."""
    from megatron_lc.data.tokenizers import TokenizerSpec

    trained = meta.get("train_config", {}).get("data", {})
    kind, model = args.tokenizer_type or trained.get("tokenizer_type"), args.tokenizer_model
    if args.tokenizer_type is None:
        model = trained.get("tokenizer_model")
    if kind is None or kind == "NullTokenizer":
        raise ConfigError("--passkey writes text: give --tokenizer-type and --tokenizer-model (the checkpoint "
                          "records no text tokenizer)")
    try:
        return TokenizerSpec(kind, model, trained.get("vocab_file"), trained.get("merge_file")).build()
    except (ValueError, OSError) as e:
        raise ConfigError(f"--tokenizer-type {kind}: {e}") from None


def evaluation_source(args, vocab_size: int | None = None) -> SampleSource:
    """The samples evaluated, in stream order: the whole blend, or one --split part of it; with `vocab_size`
    every dataset's ids are checked against the checkpoint's vocabulary as training checks them (an id beyond
    it would index past the embedding)."""
    try:
        parts = build_datasets(args.data_path, args.seq_length, seed=0, split=args.split, shuffle=False,
                               num_samples={name: args.num_samples for name in SPLIT_NAMES if args.num_samples},
                               vocab_size=vocab_size, packing=PackingSpec(args.packing, args.long_documents))
    except (OSError, ValueError) as e:
        raise ConfigError(f"--data-path {' '.join(args.data_path)}: {e}") from e
    part = args.split_part if args.split is not None else "train"  # without --split every document is "train"
    source = getattr(parts, part)
    if source is None:
        raise ConfigError(f"--split {args.split}: the {part} part is empty; give it documents or another "
                          "--split-part")
    return source


def _loss_over(loader, model, pstate, device, args) -> dict:
    buckets, S = args.loss_by_position or 1, args.seq_length
    positions = torch.tensor([p for a, b in pstate.context_layout.token_ranges(S, pstate.cp_rank)
                              for p in range(a, b)], device=device)
    sums = torch.zeros(buckets, dtype=torch.float64, device=device)
    counts = torch.zeros(buckets, dtype=torch.float64, device=device)
    samples = 0
    with torch.no_grad():
        for mb in loader:
            mb = mb.to(device)
            losses = model(mb.input_ids, mb.position_ids, mb.labels, mb.cu_seqlens, per_token=True)
            valid = (mb.labels != IGNORE_INDEX).double()
            batch = mb.input_ids.shape[0]
            where = (context_position(positions, mb.cu_seqlens, batch, S) if args.loss_by_position_in == "context"
                     else positions.expand(batch, -1))
            bucket_of = where * buckets // S
            sums.index_add_(0, bucket_of.flatten(), (losses.double() * valid).flatten())
            counts.index_add_(0, bucket_of.flatten(), valid.flatten())
            samples += mb.input_ids.shape[0] * pstate.dp_size
    if pstate.distributed:
        dist.all_reduce(sums, group=pstate.loss_group)
        dist.all_reduce(counts, group=pstate.loss_group)
    result = {"samples": samples, "tokens": samples * args.seq_length, "valid_tokens": int(counts.sum().item()),
              "loss": (sums.sum() / counts.sum().clamp(min=1)).item()}
    if args.loss_by_position:
        result["loss_by_position_in"] = ("document" if args.reset_attention_mask else "sample") \
            if args.loss_by_position_in == "context" else "sample"
        result["loss_by_position"] = [
            {"start": -(-b * S // buckets), "end": -(-(b + 1) * S // buckets), "tokens": int(counts[b].item()),
             "loss": (sums[b] / counts[b]).item() if counts[b] > 0 else None}
            for b in range(buckets)
        ]
    return result


def context_position(positions: torch.Tensor, cu_seqlens: tuple[int, ...], batch: int, seq_length: int) -> torch.Tensor:
    """[batch, local tokens]: each of this rank's tokens' position in its attention segment (`cu_seqlens`, global
    boundaries of the micro-batch's samples back to back), given the tokens' positions in their sample."""
    flat = positions.unsqueeze(0) + seq_length * torch.arange(batch, device=positions.device).unsqueeze(1)
    starts = torch.tensor(cu_seqlens, device=positions.device)
    return flat - starts[torch.searchsorted(starts, flat, right=True) - 1]
