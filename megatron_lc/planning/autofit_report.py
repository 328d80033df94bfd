"""Auto-fit's answer, as text and as JSON (the planner's `--auto-fit` output)."""


from __future__ import annotations

from megatron_lc.planning.autofit import AutoFitResult, document_layout_flags
from megatron_lc.planning.estimate import GIB, Estimate
from megatron_lc.planning.report import packed_lines
from megatron_lc.planning.timing import StepTime


def with_document_layout(command: list[str], cost: StepTime) -> list[str]:
    """`command` with the --cp-document-layout the answer was predicted at (replacing a given one)."""
    flags = document_layout_flags(cost)
    if not flags:
        return command
    out, skip = [], False
    for arg in command:
        if skip:
            skip = False
        elif arg == flags[0]:
            skip = True
        elif not arg.startswith(flags[0] + "="):
            out.append(arg)
    return out + flags


def _estimate_json(e: Estimate) -> dict:
    return {"fits": e.fits, "gpu_peak_gib": round(e.gpu_peak_bytes / GIB, 3),
            "host_peak_gib": round(e.host_bytes_per_node / GIB, 3), **({"at_least": True} if e.at_least else {})}


def auto_fit_json(result: AutoFitResult, command: list[str] | None = None, num_gpus: int | None = None) -> dict:
    """The answer (layout, flags, memory, predicted step time), the runner-up, the rates, each layout's verdict
    and every trace."""
    out: dict = {"flags": None, "fits": False, "candidates": result.candidates, "capped": result.capped,
                 "tolerance": result.tolerance, "layout_searched": result.layout_searched,
                 "rates": result.time_model.rates.name, "attention_rates": result.time_model.family}
    if result.choice is not None:
        out.update(flags=result.choice.flags(), **_estimate_json(result.estimate), time=result.cost.to_json())
        out["layout"] = {"flags": result.layout.flags(), "context_parallel_size": result.layout.cp,
                         "cp_comm_type": result.layout.comm_type,
                         "hierarchical_context_parallel_sizes": list(result.layout.hierarchical)}
        if command is not None:
            out["command"] = with_document_layout(command, result.cost) + result.choice.flags()
    runner_up = result.runner_up
    if runner_up is not None:
        out["runner_up"] = {"flags": runner_up.candidate.flags(), **_estimate_json(runner_up.estimate),
                            "layout": runner_up.layout.flags() if runner_up.layout else None,
                            "time": runner_up.cost.to_json()}
    if num_gpus is not None:
        out["layouts"] = [{"layout": v.layout.describe(num_gpus), "flags": v.layout.flags(), "verdict": v.reason}
                          for v in result.verdicts]
    out["traced"] = [{"flags": t.candidate.flags(), "layout": t.layout.flags() if t.layout else None,
                      **_estimate_json(t.estimate), "step_s": round(t.cost.step_s, 6)} for t in result.traced]
    return out


def _choice_lines(title: str, flags: list[str], e: Estimate, c: StepTime) -> list[str]:
    causes = ", ".join(f"{k} {v:.2f}" for k, v in c.seconds.items() if v >= 0.005)
    return [f"{title}: {' '.join(flags) or '(none: no memory technique needed)'}",
            f"  GPU {e.gpu_peak_bytes / GIB:.2f} GiB of {e.gpu_budget_bytes / GIB:.2f}; "
            f"host {e.host_bytes_per_node / GIB:.0f} GiB per node of {e.host_budget_bytes / GIB:.0f}",
            f"  predicted step {c.step_s:.2f} s ({c.tokens:,} tokens), {c.tokens_per_s:,.0f} tokens/s, "
            f"MFU {100 * c.mfu:.1f}% (s: {causes})",
            f"  floor {c.floor_s:.2f} s (every FLOP once at kernel rates): the step is {c.step_s / c.floor_s:.3f}x it; "
            f"over it (s): {', '.join(f'{k} {v:.2f}' for k, v in c.gap_s.items())}", *packed_lines(c)]


def auto_fit_text(result: AutoFitResult, command: list[str] | None = None, num_gpus: int | None = None) -> str:
    """For people: the layout and flags to paste, the memory, the predicted step time, the runner-up, why each
    other layout was not chosen, and the traces."""
    lines = [f"auto-fit: {len(result.traced)} of {result.candidates} candidate stacks traced"
             + (f" over {len(result.verdicts)} layouts" if result.layout_searched else "")
             + (" (trace cap reached: the fastest known to fit, maybe not the fastest)" if result.capped else "")]
    if result.choice is None:
        lines.append("no candidate fits: not even the strongest stack")
    else:
        if num_gpus is not None and result.layout is not None:
            lines.append(f"layout: {result.layout.describe(num_gpus)}"
                         + (" (searched)" if result.layout_searched else " (as given)"))
        title = "fastest stack that fits" + (f" (within {100 * result.tolerance:g}% of the fastest predicted)"
                                             if result.tolerance else "")
        lines += _choice_lines(title, result.choice.flags(), result.estimate, result.cost)
        if command is not None:
            lines.append("paste: " + " ".join(with_document_layout(command, result.cost) + result.choice.flags()))
        if result.runner_up is not None:
            r = result.runner_up
            lines += _choice_lines("runner-up (traced)", (r.layout.flags() if r.layout and result.layout_searched
                                                         else []) + r.candidate.flags(), r.estimate, r.cost)
    m = result.time_model
    lines.append(f"step times predicted at the {m.rates.name} rates, attention as {m.family} (planning/timing.py; "
                 "predictions, not measurements)")
    if num_gpus is not None and len(result.verdicts) > 1:
        lines.append("layouts:")
        lines += [f"  {v.layout.describe(num_gpus):<32} {v.reason}" for v in result.verdicts]
    lines.append("traced (in order):")
    for t in result.traced:
        verdict = "fits" if t.estimate.fits else ("no (host)" if t.estimate.fits_gpu else "no")
        where = f"[{t.layout.describe(num_gpus)}] " if num_gpus is not None and t.layout else ""
        over = ">=" if t.estimate.at_least else "  "  # the fewer traced layers were over already
        lines.append(f"  {verdict:<9} GPU {over}{t.estimate.gpu_peak_bytes / GIB:8.2f} GiB  host/node {over}"
                     f"{t.estimate.host_bytes_per_node / GIB:7.0f} GiB  step {t.cost.step_s:9.3f} s  "
                     f"{where}{' '.join(t.candidate.flags()) or '(no memory flags)'}")
    return "\n".join(lines)
