"""The planner's command line (`tools/estimate_memory.py`): per-GPU and host memory of a training
configuration, the longest context that fits, the step time, and auto-fit.

Takes the training flags (python -m megatron_lc.train --help) plus the machine's:

    python tools/estimate_memory.py --model llama3-8b --bf16 --seq-length 5242880 \\
        --context-parallel-size 8 --recompute-granularity full --offload-activations \\
        --tiled-mlp --tiled-loss --num-gpus 8 --machine dgx-h100

    ... --find-max-seq-length          the longest length that fits
    ... --ablate [--plot FILE.png]     the longest length with each memory layer added in turn
    ... --auto-fit                     the fastest memory stack that fits at --seq-length, as flags
                                       for python -m megatron_lc.train (see megatron_lc/planning/autofit.py)
    ... --json                         one JSON object instead of tables

It traces one real training step of the configuration with fake tensors on a fake
process group (see docs/memory_planner.md); nothing is allocated and no GPU is needed.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_lc.errors import ConfigError
from megatron_lc.command_line import ArgumentParser, run_tool
from megatron_lc.arguments import build_parser, parse_config
from megatron_lc.planning.estimate import Machine, planning_config
from megatron_lc.training.memory_plan import planned_run
from megatron_lc.planning.machine import DEFAULT_NODE, NODES
from megatron_lc.planning.autofit import DEFAULT_MAX_TRACES, TOLERANCE
from megatron_lc.plan_cache import CACHE_ENV
from megatron_lc.planning.estimate_pool import MAX_WORKERS
from megatron_lc.planning.gpu_allocations import NcclSettings
from megatron_lc.planning.packed_work import check_packed_planning

NCCL = NcclSettings()
AUTO_FIT_HELP = (
    "choose the fastest memory stack that fits at --seq-length and print its flags for python -m "
    "megatron_lc.train (the given recompute, offload, tiling and --cp-impl flags are replaced); fastest by the "
    "predicted step time at the machine's rates (planning/timing.py)")


def add_planner_flags(parser: argparse.ArgumentParser) -> None:
    """The machine and what to compute."""
    group = parser.add_argument_group("planner")
    group.add_argument("--num-gpus", type=int, default=8, help="GPUs of the run (the world size) (default: 8)")
    group.add_argument("--machine", choices=sorted(NODES), default=DEFAULT_NODE,
                       help="the kind of node: its GPUs' memory as the driver reports it, GPUs per node, host RAM "
                            "(docs/memory_planner.md lists each figure's source); local: this machine's CPU, its rates "
                            "measured once, for validation (default: %(default)s)")
    group.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the machine's)")
    group.add_argument("--gpu-memory-gib", type=float, default=None,
                       help="memory of one GPU as cudaMemGetInfo reports it (default: the machine's, 79.11 for an "
                            "80 GB H100)")
    group.add_argument("--host-memory-gib", type=float, default=None,
                       help="physical host memory per node (default: the machine's, 1907 for a DGX H100's 2 TB)")
    group.add_argument("--host-reserve-gib", type=float, default=None,
                       help="host memory per node kept from offloaded activations, as one number (default: "
                            "itemized: struct page, page-locking bookkeeping, the training processes, checkpoint "
                            "staging, the OS)")
    group.add_argument("--reserve-gib", type=float, default=None,
                       help="GiB below the card kept free for everything that is not a traced tensor or NCCL "
                            "buffer, as one number (default: itemized: CUDA context, cuBLAS workspaces, allocator "
                            "overhead, NCCL device structures and NVLS, page tables, a model-error margin)")
    group.add_argument("--no-expandable-segments", action="store_true",
                       help="the run's PYTORCH_CUDA_ALLOC_CONF turns expandable segments off: reserve 2.9 GiB more "
                            "for fragmentation")
    group.add_argument("--nccl-nvls", action="store_true",
                       help="NCCL's NVLink SHARP is on (NCCL_NVLS_ENABLE unset on an NVSwitch node): reserve its "
                            "buffers (the recipes export NCCL_NVLS_ENABLE=0)")
    group.add_argument("--nccl-buffsize", type=int, default=NCCL.buffsize,
                       help=f"NCCL_BUFFSIZE of the run, in bytes (default: NCCL's {NCCL.buffsize})")
    group.add_argument("--nccl-channels", type=int, default=NCCL.channels,
                       help=f"NCCL ring/tree channels per communicator (default: {NCCL.channels}, assumed)")
    group.add_argument("--nccl-p2p-channels-per-peer", type=int, default=NCCL.p2p_channels_per_peer,
                       help="NCCL channels per peer of all-to-all traffic (default: "
                            f"{NCCL.p2p_channels_per_peer}, what NCCL picks on 8xH100)")
    group.add_argument("--nccl-net-channels-per-peer", type=int, default=NCCL.net_channels_per_peer,
                       help="NCCL_NCHANNELS_PER_NET_PEER of the run: channels to a peer on another node "
                            f"(default: NCCL's {NCCL.net_channels_per_peer})")
    group.add_argument("--with-flash-attn", action="store_true",
                       help="flash-attn is installed on the GPU machines (decides what --attention-kernel auto "
                            "runs; torch's flash kernel otherwise, which allocates the same)")
    group.add_argument("--with-fa3", action="store_true",
                       help="FA3's flash_attn_interface is installed on the GPU machines: --flash-attention-impl "
                            "auto puts it behind torch's flash kernel on H100/H200 (its allocations as FA3's varlen "
                            "kernels make them, its speed at FA3's rates; not for calls past its backward's "
                            "workspace, about 16.7M tokens at head dim 128)")
    group.add_argument("--find-max-seq-length", action="store_true", help="search the longest length that fits")
    group.add_argument("--ablate", action="store_true",
                       help="the longest length with each memory layer added in turn (FSDP, Ulysses, "
                            "checkpointing, offload, tiling, Untied Ulysses)")
    group.add_argument("--plot", metavar="FILE.png", default=None,
                       help="plot per-GPU memory against length, one curve per memory layer (runs the ablation)")
    group.add_argument("--auto-fit", action="store_true", help=AUTO_FIT_HELP)
    group.add_argument("--auto-fit-max-traces", type=int, default=DEFAULT_MAX_TRACES,
                       help=f"auto-fit: at most this many estimates (default: {DEFAULT_MAX_TRACES})")
    group.add_argument("--auto-fit-tolerance", type=float, default=TOLERANCE,
                       help="auto-fit: predicted steps closer than this fraction are not told apart; the answer is "
                            "within it of the fastest stack that fits (0: the fastest itself, more traces) "
                            f"(default: {TOLERANCE})")
    group.add_argument("--planner-workers", type=int, default=None,
                       help="processes tracing at once (default: one per core, at most "
                            f"{MAX_WORKERS}; each takes about 1 GiB)")
    group.add_argument("--planner-cache", default=None, metavar="DIR",
                       help="where estimates are remembered across calls, keyed by configuration, machine and code "
                            f"(default: ${CACHE_ENV}, else ~/.cache/megatron_lc/plans; 'off': none); a command line "
                            "answered before with the same code and files is printed from it at once")
    group.add_argument("--exact", action="store_true",
                       help="trace Untied Ulysses' per-rank projection loops over every rank of the cp group and "
                            "every step of a ring (the reference; slower), not over two ranks and a ring's steps 0, 1 "
                            "and last (the default: the same bytes, tests/planning/test_fast_estimate.py)")
    group.add_argument("--json", action="store_true", help="print one JSON object")


PLANNER_FLAGS = ("num_gpus", "machine", "no_expandable_segments", "nccl_nvls", "gpus_per_node", "gpu_memory_gib",
                 "host_memory_gib", "host_reserve_gib",
                 "reserve_gib", "nccl_buffsize", "nccl_channels", "nccl_p2p_channels_per_peer",
                 "nccl_net_channels_per_peer", "with_flash_attn", "with_fa3",
                 "find_max_seq_length", "ablate", "plot", "auto_fit", "auto_fit_max_traces", "auto_fit_tolerance",
                 "planner_workers", "planner_cache", "exact", "json")


def parse(argv: list[str]) -> tuple[argparse.Namespace, object]:
    """(planner flags, TrainConfig) from the command line."""
    parser = build_parser()
    parser.prog = "tools/estimate_memory.py"
    parser.description = __doc__.splitlines()[0]
    add_planner_flags(parser)
    args = parser.parse_args(argv)  # validates every flag and serves --help
    planner, training = split_argv(argv)
    check_planner_flags(planner)
    cfg = parse_config(training + (["--mock-data"] if not args.data_path else []))
    check_packed_planning(cfg, args.mock_data)
    return planner, cfg


def check_planner_flags(planner: argparse.Namespace) -> None:
    """Sizes that cannot describe a machine, refused by flag before any tracing."""
    if not 0 <= planner.auto_fit_tolerance < 1:
        raise ConfigError(f"--auto-fit-tolerance {planner.auto_fit_tolerance} must be in [0, 1)")
    for name in ("num_gpus", "gpus_per_node", "auto_fit_max_traces", "planner_workers", "nccl_buffsize", "nccl_channels",
                 "nccl_p2p_channels_per_peer", "nccl_net_channels_per_peer"):
        value = getattr(planner, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {value} must be >= 1")
    for name in ("gpu_memory_gib", "host_memory_gib"):
        value = getattr(planner, name)
        if value is not None and not value > 0:
            raise ConfigError(f"--{name.replace('_', '-')} {value} must be > 0")
    for name in ("host_reserve_gib", "reserve_gib"):
        value = getattr(planner, name)
        if value is not None and not value >= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {value} must be >= 0")


def split_argv(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(planner flags, the training flags: what python -m megatron_lc.train takes) of a command line."""
    planner_only = ArgumentParser(add_help=False)
    add_planner_flags(planner_only)
    return planner_only.parse_known_args(argv)



def machine_of(planner: argparse.Namespace, cfg) -> Machine:
    device = "cpu" if cfg.train.device == "cpu" else "cuda"
    return Machine(num_gpus=planner.num_gpus, node=planner.machine, gpus_per_node=planner.gpus_per_node,
                   gpu_memory_gib=planner.gpu_memory_gib, host_memory_gib=planner.host_memory_gib,
                   host_reserve_gib=planner.host_reserve_gib, reserve_gib=planner.reserve_gib,
                   nccl=NcclSettings(buffsize=planner.nccl_buffsize, channels=planner.nccl_channels,
                                     p2p_channels_per_peer=planner.nccl_p2p_channels_per_peer,
                                     net_channels_per_peer=planner.nccl_net_channels_per_peer),
                   expandable_segments=not planner.no_expandable_segments, nvls=planner.nccl_nvls,
                   device=device, flash_attn=planner.with_flash_attn, fa3=planner.with_fa3)


def estimate_pool_of(planner: argparse.Namespace):
    """The estimate pool of this call: its workers and its cache."""
    from pathlib import Path

    from megatron_lc.plan_cache import default_cache_dir
    from megatron_lc.planning.estimate_pool import EstimateCache, EstimatePool, default_workers

    given = planner.planner_cache
    cache_dir = default_cache_dir() if given is None else (None if given == "off" else Path(given))
    return EstimatePool(workers=planner.planner_workers or default_workers(), cache=EstimateCache(cache_dir),
                        exact=planner.exact)


def progress_printer(pool):
    """A line on stderr per estimate of a length search, with elapsed time, traces and ETA."""
    def progress(e) -> None:
        print(f"  {pool.progress()} {e.seq_length:>12,} tokens: GPU {e.gpu_peak_bytes / 2**30:7.2f} GiB, "
              f"host/node {e.host_bytes_per_node / 2**30:8.1f} GiB -> {'fits' if e.fits else 'no'}", file=sys.stderr,
              flush=True)
    return progress


def auto_fit_printer(pool, num_gpus: int):
    """A line on stderr per estimate of the auto-fit search."""
    def progress(candidate, e, layout) -> None:
        over = ">=" if e.at_least else "  "  # the fewer traced layers were over already
        print(f"  {pool.progress()} GPU {over}{e.gpu_peak_bytes / 2**30:7.2f} GiB, host/node "
              f"{over}{e.host_bytes_per_node / 2**30:8.1f} GiB -> {'fits' if e.fits else 'no'}: "
              f"[{layout.describe(num_gpus)}] "
              f"{' '.join(candidate.flags()) or '(no memory flags)'}", file=sys.stderr, flush=True)
    return progress


def run_auto_fit(planner: argparse.Namespace, cfg, machine: Machine, argv: list[str], out: dict, pool) -> bool:
    """--auto-fit: the fastest layout and stack that fit, printed (or added to `out` under `auto_fit`)."""
    from megatron_lc.planning import autofit, autofit_report, layouts, search_space

    training = split_argv(argv)[1]
    layouts = None if layout_given(training) else layouts.search_layouts(cfg, machine.num_gpus, machine.gpus_per_node)
    result = autofit.auto_fit(cfg, machine, None, planner.auto_fit_max_traces, evaluate=pool,
                              on_estimate=auto_fit_printer(pool, machine.num_gpus), layouts=layouts,
                              tolerance=planner.auto_fit_tolerance)
    layout_flags = result.layout.flags() if result.layout is not None and layouts is not None else []
    command = launch_command(machine, search_space.strip_memory_flags(training) + layout_flags)
    if result.estimate is not None:
        out.update(result.estimate.to_json())
    else:
        out.update(seq_length=cfg.data.seq_length, fits=False, gpu_peak_gib=None, host_peak_gib=None)
    out["auto_fit"] = autofit_report.auto_fit_json(result, command, machine.num_gpus)
    if result.choice is None:
        out["auto_fit"]["reason"] = no_fit_reason(min((t.estimate for t in result.traced),
                                                      key=lambda e: e.gpu_peak_bytes, default=None),
                                                  "the strongest stack traced")
    if not planner.json:
        print(autofit_report.auto_fit_text(result, command, machine.num_gpus))
        if result.choice is None:
            print(out["auto_fit"]["reason"])
        elif DATA_PLACEHOLDER in command:
            print(f"  ({DATA_PLACEHOLDER}: the --output-prefix of tools/preprocess_data.py with _text_document, "
                  "or --mock-data; the planner was given no data flags)")
    return result.choice is not None


def layout_given(training: list[str]) -> bool:
    """Whether the training flags name the parallel layout (auto-fit keeps it), or leave it to auto-fit."""
    from megatron_lc.planning.layouts import LAYOUT_FLAGS

    return bool({arg.split("=", 1)[0] for arg in training} & set(LAYOUT_FLAGS))


DATA_PLACEHOLDER = "YOUR_DATA_PREFIX"
DATA_FLAGS = ("--data-path", "--train-data-path", "--mock-data")


def launch_command(machine: Machine, training: list[str]) -> list[str]:
    """The command that runs `training` on `machine`: torchrun with one process per GPU (on each node, with a
    rendezvous endpoint to fill in when there are several), and a data placeholder when none was given."""
    nodes = -(-machine.num_gpus // machine.gpus_per_node)
    launcher = ["torchrun", "--nproc-per-node", str(machine.gpus_on_node)]
    if nodes > 1:  # run on every node; MASTER_HOST is the first node's address
        launcher += ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", "MASTER_HOST:29500"]
    has_data = any(arg.split("=", 1)[0] in DATA_FLAGS for arg in training)
    data = [] if has_data else ["--data-path", DATA_PLACEHOLDER]
    return [*launcher, "-m", "megatron_lc.train", *training, *data]


def no_fit_reason(e, what: str) -> str:
    """Why nothing fits, from the estimate that came closest."""
    if e is None:
        return "nothing fits: no estimate was made"
    return (f"nothing fits: {what} ({e.seq_length:,} tokens) needs GPU {e.gpu_peak_bytes / 2**30:.2f} GiB of "
            f"{e.gpu_budget_bytes / 2**30:.2f} and host {e.host_bytes_per_node / 2**30:.1f} GiB per node of "
            f"{e.host_budget_bytes / 2**30:.1f}: more GPUs (--num-gpus), a larger --context-parallel-size, or a "
            "shorter --seq-length")


def main(argv: list[str] | None = None) -> int:
    """0 when the plan was printed, 1 when nothing fits (with the reason), 2 on a configuration error."""
    return run_tool("estimate_memory", plan, sys.argv[1:] if argv is None else list(argv))


def validate_plan(planner: argparse.Namespace, cfg, argv: list[str]) -> None:
    """The configuration's errors as one line before any tracing (auto-fit replaces the memory flags, so
    only the rest must hold)."""
    from megatron_lc.planning import layouts, search_space

    if planner.auto_fit and (planner.ablate or planner.plot or planner.find_max_seq_length):
        raise ConfigError("--auto-fit chooses a stack at one --seq-length: not together with --find-max-seq-length, "
                          "--ablate or --plot")
    checked = cfg
    if planner.auto_fit and (cfg.memory.recompute_method or cfg.memory.recompute_num_layers):
        raise ConfigError("--auto-fit chooses the recompute of every block: drop --recompute-method and "
                          "--recompute-num-layers (or plan that stack without --auto-fit)")
    if planner.auto_fit:
        training = search_space.strip_memory_flags(split_argv(argv)[1])
        checked = parse_config(training + (["--mock-data"] if not cfg.data.data_path else []))
        if not layout_given(training):
            gpus_per_node = planner.gpus_per_node or NODES[planner.machine].gpus_per_node
            layouts.search_layouts(checked, planner.num_gpus, gpus_per_node)  # one that validates, or one line
            return
    planning_config(checked).validate(planner.num_gpus)


STACK_HINT = ("--bf16 --context-parallel-size N --cp-impl untied_ulysses --recompute-granularity full "
              "--offload-mode prefetch --tiled-mlp --tiled-loss")
"""The memory stack a long-context run uses (the recipes' in examples/)."""


def stack_hint(planner: argparse.Namespace, argv: list[str]) -> str | None:
    """One line when the command plans no memory stack at all (plain FSDP at cp 1), naming the stack to plan;
    None when it names any part of one, ablates or auto-fits."""
    from megatron_lc.planning.search_space import MEMORY_FLAGS

    if planner.auto_fit or planner.ablate or planner.plot:
        return None
    given = {arg.split("=", 1)[0] for arg in split_argv(argv)[1]}
    if given & {*MEMORY_FLAGS, "--context-parallel-size", "--cp-comm-type", "--bf16"}:
        return None
    return ("estimate_memory: planning plain FSDP in fp32 at --context-parallel-size 1 with no memory stack (no "
            f"stack flag given); a long-context run plans {STACK_HINT}, or --auto-fit chooses one")


def plan(argv: list[str]) -> int:
    planner, cfg = parse(argv)
    validate_plan(planner, cfg, argv)
    hint = stack_hint(planner, argv)
    if hint:
        print(hint, file=sys.stderr, flush=True)
    try:
        machine = machine_of(planner, cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    out: dict = {}
    fits = True
    with estimate_pool_of(planner) as pool:
        fits = run_plan(planner, cfg, machine, argv, out, pool)
    if planner.json:
        print(json.dumps(out, indent=1))
    return 0 if fits else 1


def run_plan(planner: argparse.Namespace, cfg, machine: Machine, argv: list[str], out: dict, pool) -> bool:
    """What the flags ask for, printed or put in `out`; False when nothing fits."""
    from megatron_lc.planning import report, search

    fits = True
    progress = progress_printer(pool)
    if planner.auto_fit:
        fits = run_auto_fit(planner, cfg, machine, argv, out, pool)
    if planner.ablate or planner.plot:
        rows = search.ablate(cfg, machine, on_estimate=progress, evaluate=pool)
        out.update(report.ablation_json(rows))
        if not planner.json:
            print(report.ablation_table(rows))
        if planner.plot:
            title = f"{cfg.model.model} on {machine.num_gpus} GPUs ({machine.gpu_memory_gib:g} GiB)"
            report.plot_memory(rows, planner.plot, title, machine.gpu_memory_gib)
    if planner.find_max_seq_length:
        result = search.find_max_seq_length(cfg, machine, evaluate=pool, on_estimate=progress)
        out.update(report.search_json(result))
        if not result.max_seq_length:
            fits = False
            out["reason"] = no_fit_reason(min(result.evaluated, key=lambda e: e.seq_length, default=None),
                                          "the shortest length tried")
        if not planner.json:
            bound = {"GPU": " (bound by GPU memory)", "host": " (bound by the node's host memory)"}
            print(f"longest length that fits: {result.max_seq_length:,} tokens{bound.get(result.bound_by, '')}")
            if result.best:
                print(report.estimate_table(planning_config(cfg, result.max_seq_length), result.best))
            else:
                print(out["reason"])
    if not (planner.ablate or planner.plot or planner.find_max_seq_length or planner.auto_fit):
        if not pool.remembers((cfg, machine, None)):
            print(f"  estimating {cfg.data.seq_length:,} tokens on {machine.num_gpus} GPUs: two traced steps of a few "
                  "layers" + (", every rank and ring step (--exact)" if pool.exact else ""), file=sys.stderr,
                  flush=True)
        e = pool(cfg, machine)
        out.update(e.to_json())
        out["run"] = planned_run(cfg, machine.num_gpus)  # what a run given this plan (--memory-plan) checks
        if not planner.json:
            print(report.estimate_table(cfg, e))
    return fits


if __name__ == "__main__":
    sys.exit(main())
