"""The blending index at 10^7 samples: this framework's vectorised numpy against megatron-core's C++.

    python bench/bench_blending.py [--samples 10000000] [--weights 0.7 0.2 0.1]

Prints one line per implementation (best of --repeats) and whether the two indices are equal
bit for bit. A pure-Python loop over the samples (the previous implementation) is timed on
--python-samples and scaled, since it takes minutes at 10^7.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

from megatron_lc.data.blending import blending_indices, normalize


def python_loop(weights: list[float], size: int) -> np.ndarray:
    """The greedy, one sample at a time in Python (the implementation this replaced)."""
    counts = [0] * len(weights)
    sources = np.empty(size, dtype=np.int16)
    for i in range(size):
        step = float(max(i, 1))
        errors = [w * step - c for w, c in zip(weights, counts)]
        sources[i] = chosen = errors.index(max(errors))
        counts[chosen] += 1
    return sources


def best_of(repeats: int, run) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=10_000_000)
    p.add_argument("--weights", type=float, nargs="+", default=[0.7, 0.2, 0.1])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--python-samples", type=int, default=200_000)
    args = p.parse_args()
    weights = normalize(normalize(args.weights))
    ours_s, ours = best_of(args.repeats, lambda: blending_indices(weights, args.samples))
    print(f"numpy (this framework): {args.samples:,} samples, {len(weights)} sources: {ours_s:.2f} s")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import helpers_cpp

    def megatron():
        out = np.zeros(args.samples, dtype=np.int16), np.zeros(args.samples, dtype=np.int64)
        helpers_cpp.build_blending_indices(*out, np.array(weights), len(weights), args.samples, False)
        return out

    cpp_s, theirs = best_of(args.repeats, megatron)
    equal = np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])
    print(f"megatron-core helpers_cpp: {cpp_s:.2f} s; indices equal bit for bit: {equal}")
    loop_s, _ = best_of(1, lambda: python_loop(weights, args.python_samples))
    print(f"pure-Python loop: {loop_s:.2f} s for {args.python_samples:,} samples, "
          f"about {loop_s * args.samples / args.python_samples:.0f} s at {args.samples:,}")


if __name__ == "__main__":
    main()
