"""Tables for people, JSON for machines, and the memory-against-length plot."""

from __future__ import annotations

import dataclasses

from megatron_lc.config import TrainConfig
from megatron_lc.planning.estimate import GIB, Estimate
from megatron_lc.planning.machine import NODES, Term
from megatron_lc.planning.timing import StepTime, TimeModel, layer_costs
from megatron_lc.planning.search import SearchResult, StackLayer
from megatron_lc.planning.tracker import CATEGORIES


def describe_config(cfg: TrainConfig, num_gpus: int) -> str:
    """One line: model, length, GPUs and the memory stack switched on."""
    p, m = cfg.parallel, cfg.memory
    stack = ["FSDP" if num_gpus > 1 else "no FSDP"]
    if p.context_parallel_size > 1:
        layout = cfg.context_layout()
        if layout.ring_size == 1:
            stack.append(f"{p.cp_impl} cp={p.context_parallel_size}")
        elif layout.a2a_size == 1:
            stack.append(f"ring cp={p.context_parallel_size}")
        else:
            stack.append(f"{p.cp_impl} {layout.a2a_size} x ring {layout.ring_size}")
    if m.recompute_granularity != "none":
        stack.append(f"{m.recompute_granularity} recompute")
    stack += [name for name, on in (("offload" if m.offload_mode == "prefetch" else f"offload ({m.offload_mode})",
                                     m.offload_mode != "none"),
                                    ("kept attention output", m.keep_attention_output and m.recompute_granularity == "full"),
                                    ("tiled MLP", m.tiled_mlp), ("tiled loss", m.tiled_loss)) if on]
    dtype = "bf16" if cfg.train.bf16 else "fp32"
    return (f"{cfg.model.model}, {cfg.data.seq_length:,} tokens x {cfg.data.micro_batch_size}, {num_gpus} GPUs, "
            f"{dtype}; {', '.join(stack)}")


def _gib(value: int) -> str:
    return f"{value / GIB:8.2f} GiB"


def estimate_table(cfg: TrainConfig, e: Estimate) -> str:
    """The per-GPU breakdown, the host bytes, the verdict and the largest buffers."""
    m = e.machine
    lines = [describe_config(cfg, m.num_gpus), f"per-GPU peak, at the {e.peak_phase}:"]
    lines += [f"  {name:<22}{_gib(e.gpu_bytes_by_category[name])}" for name in CATEGORIES]
    lines.append(f"  {'total':<22}{_gib(e.gpu_peak_bytes)}   (communication includes {e.nccl_bytes / GIB:.2f} GiB "
                 f"of NCCL buffers for {e.communicators} communicator(s))")
    verdict = "fits" if e.fits_gpu else "does NOT fit"
    reserve = e.gpu_memory_bytes - e.gpu_budget_bytes
    lines.append(f"  GPU: {e.gpu_peak_bytes / GIB:.2f} + reserve {reserve / GIB:.2f} GiB of {m.gpu_memory_gib:.2f} GiB "
                 f"({describe_machine(m)}): {verdict}")
    lines += _terms(e.gpu_reserve_terms)
    verdict = "fits" if e.fits_host else "does NOT fit"
    host_reserve = int(m.host_memory_gib * GIB) - e.host_budget_bytes
    held = "offloaded activations and the optimizer's states" if cfg.optim.optimizer_cpu_offload else \
        "offloaded activations"
    lines.append(f"host ({held}, page-locked at their exact size): "
                 f"{e.host_bytes_per_gpu / GIB:.2f} GiB per GPU, "
                 f"{e.host_bytes_per_node / GIB:.2f} GiB per node of {e.host_budget_bytes / GIB:.0f} GiB "
                 f"({m.host_memory_gib:.0f} GiB less {host_reserve / GIB:.0f} GiB reserve): {verdict}")
    lines += _terms(e.host_reserve_terms)
    lines.append("largest buffers at the peak (traced layers; layers.N = any layer):")
    lines += [f"  {b / GIB:8.2f} GiB  {count:>3} x {name}" for name, count, b in e.top_buffers]
    if any(e.extra_layer_bytes.values()):
        extra = ", ".join(f"{k} {v / GIB:.2f}" for k, v in e.extra_layer_bytes.items() if v)
        lines.append(f"  plus, from the untraced layers (GiB): {extra}")
    lines += time_lines(cfg, e)
    lines.append(f"(traced {'/'.join(map(str, e.traced_layers))} layers in {e.seconds:.1f} s)")
    if any(t.assumed for t in e.gpu_reserve_terms + e.host_reserve_terms):
        lines.append("* an assumption until a GPU has measured it (docs/memory_planner.md, 'The machine')")
    return "\n".join(lines)


def time_lines(cfg: TrainConfig, e: Estimate) -> list[str]:
    """Predicted step time by cause (with FA3's rates beside FA2's where the machine has them), and what each
    memory layer costs against the same step without it."""
    if e.time is None:
        return []
    m = e.machine
    model = TimeModel.for_machine(m, cfg)
    columns = [("", e.time)]
    if model.family == "fa2" and "fa3" in model.rates.attention_fwd_flops:
        columns = [("FA2", e.time), ("FA3", dataclasses.replace(model, family="fa3").predict(cfg, m.num_gpus))]
    head = "".join(f"{name:>12}" for name, _ in columns)
    lines = [f"predicted step time ({model.rates.name} rates, planning/timing.py; a prediction):{head}"]
    for cause in e.time.seconds:
        lines.append(f"  {cause:<34}" + "".join(f"{t.seconds[cause]:>10.2f} s" for _, t in columns))
    lines.append(f"  {'step':<34}" + "".join(f"{t.step_s:>10.2f} s" for _, t in columns))
    lines.append(f"  {'tokens/s':<34}" + "".join(f"{t.tokens_per_s:>12,.0f}" for _, t in columns))
    lines.append(f"  {'MFU':<34}" + "".join(f"{100 * t.mfu:>11.1f}%" for _, t in columns))
    lines.append(f"  {'floor (every FLOP once)':<34}"
                 + "".join(f"{t.floor_s:>10.2f} s" for _, t in columns))
    lines.append(f"  {'step / floor':<34}" + "".join(f"{t.step_s / t.floor_s:>11.3f}x" for _, t in columns))
    lines.append("  what separates the step from its floor:")
    for cause in e.time.gap_s:
        lines.append(f"    {cause:<38}" + "".join(f"{t.gap_s[cause]:>8.2f} s" for _, t in columns))
    lines += packed_lines(e.time)
    costs = layer_costs(cfg, m.num_gpus, model.rates, model.gpus_per_node, model.family)
    if costs:
        lines.append("  what each memory layer costs (this step against it without that layer):")
        lines += [f"    {name:<40}{seconds:>+10.2f} s ({100 * seconds / e.time.step_s:+.1f}%)" for name, seconds in costs]
    return lines


def packed_lines(t: StepTime) -> list[str]:
    """--packing documents: where the documents' lengths came from and how evenly the layout shares their work."""
    p = t.packed
    if p is None:
        return []
    return [f"  packed documents ({p['document_lengths']}): their attention pairs {100 * p['pairs_over_full_causal']:.1f}% "
            f"of a full causal square, rates at {p['call_tokens']:,}-token calls (the token-weighted mean length)",
            f"  --cp-document-layout {p['document_layout']}: slowest rank's pairs over the mean {p['imbalance_median']:.2f}x "
            f"(median micro-batch; p90 {p['imbalance_p90']:.2f}x, worst {p['imbalance_max']:.2f}x); the step of the "
            f"slowest ranks' mean work over {p['samples']} samples"]


def describe_machine(m) -> str:
    """'8 x dgx-h100 (H100 SXM5 80GB)'-style words for the machine."""
    nodes = -(-m.num_gpus // m.gpus_per_node)
    return f"{nodes} x {m.node}, {NODES[m.node].gpu}" if m.gpu_memory_gib == NODES[m.node].gpu_memory_gib \
        else f"{nodes} x {m.node}, {m.gpu_memory_gib:g} GiB GPUs"


def _terms(terms: list[Term]) -> list[str]:
    """One line per reserve term; '*' marks an assumption no GPU has measured yet."""
    return [f"    {t.nbytes / GIB:7.2f} GiB {'*' if t.assumed else ' '} {t.name}: {t.basis}" for t in terms]


def search_json(result: SearchResult) -> dict:
    """The estimate at the longest length that fits (or the shortest tried), with `max_seq_length`."""
    shown = result.best or (result.evaluated[0] if result.evaluated else None)
    out = shown.to_json() if shown else {"seq_length": 0, "fits": False, "gpu_peak_gib": None, "host_peak_gib": None}
    out["max_seq_length"] = result.max_seq_length
    out["bound_by"] = result.bound_by
    out["evaluated"] = [{"seq_length": e.seq_length, "gpu_peak_gib": round(e.gpu_peak_bytes / GIB, 3),
                         "host_peak_gib": round(e.host_bytes_per_node / GIB, 3), "fits": e.fits}
                        for e in result.evaluated]
    return out


def ablation_table(rows: list[tuple[StackLayer, SearchResult]]) -> str:
    """Markdown: the longest context with each layer of the stack added in turn, and what sets the limit."""
    lines = ["| stack (added in turn) | longest context | bound by | GPU peak there | host per node there | "
             "largest buffers at the limit |", "| --- | ---: | --- | ---: | ---: | --- |"]
    for layer, result in rows:
        best = result.best
        if best is None:
            lines.append(f"| {layer.name} | none fits | | | | |")
            continue
        top = "; ".join(f"{count} x {name} ({nbytes / GIB:.1f} GiB)" for name, count, nbytes in best.top_buffers[:2])
        lines.append(f"| {layer.name} | {result.max_seq_length:,} | {result.bound_by or '?'} | "
                     f"{best.gpu_peak_bytes / GIB:.1f} GiB | {best.host_bytes_per_node / GIB:.0f} GiB | {top} |")
    return "\n".join(lines)


def ablation_json(rows: list[tuple[StackLayer, SearchResult]]) -> dict:
    """Every row under `ablation`; at the top level, the last row (the whole stack)."""
    table = [{"stack": layer.name, **search_json(result)} for layer, result in rows]
    return {**table[-1], "ablation": table}


def plot_memory(rows: list[tuple[StackLayer, SearchResult]], path: str, title: str, gpu_memory_gib: float) -> None:
    """GPU peak against sequence length, one curve per stack layer (every point an estimate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for layer, result in rows:
        points = sorted((e.seq_length, e.gpu_peak_bytes / GIB) for e in result.evaluated)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=layer.name)
    ax.axhline(gpu_memory_gib, color="black", linewidth=1, label=f"GPU memory ({gpu_memory_gib:g} GiB)")
    shown = [e for _, result in rows for e in ([result.best] if result.best else result.evaluated[:1])]
    if shown:  # the reserve grows a little with the page-locked bytes: the full stack's at its limit
        ax.axhline(shown[-1].gpu_budget_bytes / GIB, color="black", linestyle="--", linewidth=1, label="minus reserve")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("per-GPU peak (GiB)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
