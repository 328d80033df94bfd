"""The clock of packed data (--packing documents): the pairs each rank computes, the slowest rank deciding the step,
the floor counting each pair inside a document once, and where the documents' lengths come from."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_lc.arguments import parse_config
from megatron_lc.context_layout import ContextLayout, RankWork, packed_rank_work
from megatron_lc.data.indexed_dataset import write_dataset
from megatron_lc.data.sources import build_datasets
from megatron_lc.data.packing import PackingSpec
from megatron_lc.errors import ConfigError
from megatron_lc.planning import cli as estimate_memory
from megatron_lc.planning import packed_work
from megatron_lc.planning.packed_work import DocumentMix, total_pairs
from megatron_lc.planning.rates import FA2_BACKWARD_WORK, RATES
from megatron_lc.planning.timing import IMBALANCE, _predict, predict, predict_packed, step_work

H100 = RATES["dgx-h100"]
EIGHT_B = ["--model", "llama3-8b", "--bf16", "--seq-length", "1048576", "--context-parallel-size", "8", "--mock-data"]
STACK = ["--recompute-granularity", "full", "--offload-mode", "prefetch", "--tiled-mlp", "--tiled-loss"]


def _cfg(*flags):
    return parse_config([*EIGHT_B, *flags])


def _brute_pairs(layout: ContextLayout, cu: tuple[int, ...], S: int) -> list[float]:
    """Per cp rank: (query, key) pairs with key <= query in one document, over the queries its ring rank holds
    (under the layout's cut), shared by the ring rank's all-to-all ranks (a head share each)."""
    document = np.searchsorted(np.asarray(cu), np.arange(S), side="right") - 1
    out = []
    for rank in range(layout.cp_size):
        first = rank // layout.a2a_size * layout.a2a_size
        queries = [i for a in range(layout.a2a_size) for lo, hi in layout.token_ranges(S, first + a, cu)
                   for i in range(lo, hi)]
        out.append(sum(1 for i in queries for j in range(i + 1) if document[i] == document[j]) / layout.a2a_size)
    return out


LAYOUTS = [ContextLayout(a2a_size=2), *(ContextLayout(ring_size=R, documents=d) for R in (2, 4)
                                        for d in ("sequence", "split", "local")),
           ContextLayout(a2a_size=2, ring_size=2, documents="sequence"),
           ContextLayout(a2a_size=2, ring_size=2, documents="local")]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"a2a{l.a2a_size}-ring{l.ring_size}-{l.documents}")
def test_pairs_of_each_rank_equal_a_brute_force_count(layout):
    S = 64
    rng = np.random.default_rng(0)
    for _ in range(5):
        cuts = sorted(rng.choice(np.arange(1, S), size=int(rng.integers(0, 6)), replace=False).tolist())
        cu = tuple([0, *cuts, S])
        work = packed_rank_work(layout, cu, S)
        assert [w.pairs for w in work] == pytest.approx(_brute_pairs(layout, cu, S))
        assert sum(w.pairs for w in work) == pytest.approx(total_pairs(cu))  # each pair computed by one rank
        assert total_pairs(cu) == sum(d * (d + 1) / 2 for d in np.diff(cu))
        assert [w.tokens for w in work] == [S // layout.cp_size] * layout.cp_size


@pytest.mark.parametrize("documents", ["sequence", "split", "local"])
def test_segments_of_each_rank_are_those_its_ring_calls_hold(documents):
    """The time model's count of a ring rank's document segments (one CPU kernel call each) against the calls the
    ring's schedule makes: its own block's, and every step's."""
    from megatron_lc.attention.ring import DocumentRingSchedule, RingSchedule
    from megatron_lc.attention.varlen import segment_pairs

    S, rng = 4800, np.random.default_rng(0)
    for R in (2, 3, 4):
        layout = ContextLayout(ring_size=R, documents=documents)
        for _ in range(8):
            lengths = rng.choice([1, 5, 40, 300, 1500, 3000], size=40)
            cu = tuple(sorted({0, S, *np.minimum(np.cumsum(lengths), S).tolist()}))
            schedule = DocumentRingSchedule if layout.cuts_documents else RingSchedule
            for r, work in enumerate(packed_rank_work(layout, cu, S)):
                calls = schedule(layout, S, cu, r)
                count = len(segment_pairs(calls.own_block().cu_q, None, True))
                count += sum(len(segment_pairs(p.cu_q, p.cu_k, False)) for kv in range(R)
                             for p in calls.cross_pairs(kv))
                assert work.segments == count
    assert packed_rank_work(ContextLayout(a2a_size=2), (0, 10, 64), 64)[0].segments == 2  # one call, every document


def test_a_kernel_that_runs_a_call_per_segment_pays_for_each():
    """Rates with a cost per segment (the CPU's kernel) add it to every attention pass; the GPU's kernels take
    every segment in one launch and pay nothing per segment."""
    cfg = _cfg("--packing", "documents", "--cp-comm-type", "p2p", "--recompute-granularity", "full")
    spec = cfg.run_spec(8)
    work = step_work(cfg, 8, spec, RankWork(131072, 1e9, 0, 131072, segments=300))
    assert work.attention_segments == 300
    per_segment = dataclasses.replace(H100, segment_s={"fa2": (1e-3, 2e-3)})
    plain, paying = (_predict(cfg, 8, spec, work, rates, 8, "fa2", 2048) for rates in (H100, per_segment))
    L = cfg.model_config().num_layers
    for cause, seconds in (("attention forward", L * 300 * 1e-3), ("attention recompute", L * 300 * 1e-3),
                           ("attention backward", L * 300 * 2e-3)):
        assert paying.seconds[cause] - plain.seconds[cause] == pytest.approx(seconds)
    assert paying.floor_s == plain.floor_s  # the floor is the FLOPs at the kernels' rates


@pytest.mark.parametrize("ring, documents", [(1, "sequence"), (2, "sequence"), (4, "split"), (8, "local")])
def test_an_unpacked_sample_has_the_segments_of_one_document(ring, documents):
    """Without packing each sample is one document: the time model's count is `packed_rank_work`'s of one document
    (which the test above holds to the ring's calls)."""
    cp = ring * 2 if ring > 1 else 2
    flags = ["--context-parallel-size", str(cp)]
    if ring > 1:
        flags += ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", str(ring),
                  "--cp-document-layout", documents]
    cfg, S = _cfg(*flags), 1048576
    layout = cfg.run_spec(cp).parallelize.cp.layout
    assert layout.ring_size == ring
    one = packed_rank_work(layout, (0, S), S)
    assert {w.segments for w in one} == {step_work(cfg, cp).attention_segments}


def test_segments_decide_the_slowest_rank_only_where_they_cost_time():
    """Rates without a cost per segment (the GPUs') keep one candidate a step, one prediction a stack."""
    from megatron_lc.planning import timing

    cfg = _cfg("--packing", "documents", "--cp-comm-type", "p2p")
    mix, layout = packed_work.document_mix(cfg), cfg.run_spec(8).parallelize.cp.layout
    free = timing._packed_shares(layout, mix, 1048576, 1, 1, timing._FIELDS[:-1])
    priced = timing._packed_shares(layout, mix, 1048576, 1, 1, timing._FIELDS)
    assert free.slowest_mean is not None
    assert sum(len(s.candidates) for s in priced.steps) > sum(len(s.candidates) for s in free.steps)


def test_the_step_prices_the_exchanged_tokens_only():
    """A rank's all-to-all and ring bytes scale with the tokens it sends: none sent, none exposed."""
    cfg = _cfg("--packing", "documents", "--cp-comm-type", "p2p")
    spec = cfg.run_spec(8)
    sent = step_work(cfg, 8, spec, RankWork(131072, 1e9, 0, 131072))
    kept = step_work(cfg, 8, spec, RankWork(131072, 1e9, 0, 0))
    assert sent.ring_bytes_fwd == pytest.approx(step_work(_cfg("--cp-comm-type", "p2p"), 8).ring_bytes_fwd)
    assert kept.ring_bytes_fwd == kept.ring_bytes_bwd == 0 and kept.gemm_fwd == sent.gemm_fwd
    untied = _cfg("--packing", "documents", "--cp-impl", "untied_ulysses")
    assert step_work(untied, 8, untied.run_spec(8), RankWork(131072, 1e9, 131072, 0)).a2a_bytes == pytest.approx(
        step_work(_cfg("--cp-impl", "untied_ulysses"), 8).a2a_bytes)


def test_one_document_a_sample_is_the_unpacked_step():
    """A mix whose samples are one document each predicts today's step (Ulysses: even shares of the square)."""
    cfg = _cfg("--packing", "documents", "--cp-impl", "untied_ulysses", *STACK)
    plain = predict(_cfg("--cp-impl", "untied_ulysses", *STACK), 8, H100, family="fa3")
    one = predict_packed(cfg, 8, cfg.run_spec(8), DocumentMix(((0, 1048576),) * 2, "one document"), H100, 8, "fa3")
    assert one.step_s == pytest.approx(plain.step_s, rel=1e-6)
    assert one.floor_s == pytest.approx(plain.floor_s, rel=1e-6)  # S (S+1)/2 pairs against S^2/2: within 1e-6


def test_packed_step_is_far_below_the_unpacked_one_and_near_its_own_floor():
    for flags in (["--cp-impl", "untied_ulysses"], ["--cp-comm-type", "p2p"]):
        packed = predict(_cfg("--packing", "documents", *flags, *STACK), 8, H100, family="fa3")
        plain = predict(_cfg(*flags, *STACK), 8, H100, family="fa3")
        assert packed.step_s < 0.2 * plain.step_s
        assert packed.floor_s < 0.1 * plain.floor_s
        assert packed.packed["samples"] == packed_work.SAMPLES
        assert "assumed length mix" in packed.packed["document_lengths"]
        assert 0.02 < packed.packed["pairs_over_full_causal"] < 0.05  # the mix at 1M: about 3.5%
        assert packed.to_json()["packed"]["imbalance_median"] >= 1


def test_the_floor_counts_each_pair_inside_a_document_once_whatever_the_cut():
    S = 1048576
    mix = DocumentMix(((0, 600_000, 700_000, 1_000_000, S), (0, 300_000, S)), "two samples")
    floors = []
    for flags in (["--cp-impl", "untied_ulysses"], ["--cp-comm-type", "p2p"], ["--context-parallel-size", "4"]):
        cfg = _cfg("--packing", "documents", *flags)
        t = predict_packed(cfg, 8, cfg.run_spec(8), mix, H100, 8, "fa3")
        cp = cfg.parallel.context_parallel_size
        w = step_work(_cfg(*flags), 8)  # the GEMMs of S/cp tokens
        pairs = np.mean([total_pairs(cu) for cu in mix.samples]) / cp
        attention = 32 * 4 * pairs * 128 * 32
        assert t.floor_s == pytest.approx(3 * w.gemm_fwd / H100.gemm_flops + attention / 648e12
                                          + FA2_BACKWARD_WORK * attention / 561e12, rel=1e-9)
        assert t.floor_s + sum(t.gap_s.values()) == pytest.approx(t.step_s, rel=1e-9)
        floors.append(t.floor_s * cp)
    assert floors[0] == pytest.approx(floors[1], rel=1e-9)  # ring or all-to-all: the same pairs once


def test_the_slowest_rank_decides_the_step():
    """A ring of 2 on a sample whose long document lies in the last chunk (ring rank 0's): rank 0 does most of the
    attention, and the step is its step."""
    S = 1048576
    cu = (0, *range(4096, 786432 + 1, 4096), S)  # short documents, then one of 262,144 in chunk 3
    cfg = _cfg("--packing", "documents", "--context-parallel-size", "2", "--cp-comm-type", "p2p",
               "--cp-document-layout", "sequence")
    spec = cfg.run_spec(8)
    t = predict_packed(cfg, 8, spec, DocumentMix((cu,) * 4, "skewed"), H100, 8, "fa3")
    ranks = packed_rank_work(spec.parallelize.cp.layout, cu, S)
    assert ranks[0].pairs > 3 * ranks[1].pairs
    slowest = _predict(cfg, 8, spec, step_work(cfg, 8, spec, ranks[0]), H100, 8, "fa3", t.packed["call_tokens"])
    assert t.step_s == pytest.approx(slowest.step_s, rel=1e-9)
    assert t.packed["imbalance_median"] == pytest.approx(ranks[0].pairs / np.mean([r.pairs for r in ranks]))
    assert t.gap_s[IMBALANCE] > 0


def test_attention_rates_are_taken_at_the_token_weighted_mean_document_length():
    mix = DocumentMix(((0, 1000, 4000, 4096),), "x")
    lengths = np.array([1000, 3000, 96])
    assert mix.call_tokens == round((lengths ** 2).sum() / lengths.sum())


def test_mock_data_with_packed_documents_is_refused_naming_data_path():
    with pytest.raises(ConfigError, match="--data-path") as e:
        estimate_memory.parse([*EIGHT_B, "--packing", "documents"])
    assert "\n" not in str(e.value)


def test_a_data_path_without_its_files_is_refused_in_one_line(tmp_path):
    cfg = parse_config(["--model", "debug", "--seq-length", "64", "--packing", "documents", "--data-path",
                        str(tmp_path / "missing"), "--split", "1,0,0"])
    with pytest.raises(ConfigError, match="--packing documents") as e:
        predict(cfg, 1, H100)
    assert "\n" not in str(e.value)


def test_a_data_path_gives_the_runs_own_first_samples(tmp_path):
    rng = np.random.default_rng(1)
    prefix = str(tmp_path / "chat_text_document")
    write_dataset(prefix, [rng.integers(1, 100, size=int(n)) for n in rng.integers(2, 60, size=400)])
    flags = ["--model", "debug", "--seq-length", "128", "--packing", "documents", "--data-path", prefix,
             "--split", "98,2,0", "--context-parallel-size", "2", "--cp-comm-type", "p2p"]
    planner, cfg = estimate_memory.parse(flags)
    t = predict(cfg, 2, H100)
    train = build_datasets([prefix], 128, cfg.train.seed, split="98,2,0", packing=PackingSpec("documents")).train
    mix = packed_work.document_mix(cfg)
    assert mix.samples == tuple(train.cu_seqlens(k) for k in range(packed_work.SAMPLES))
    assert prefix in t.packed["document_lengths"] and "assumed" not in t.packed["document_lengths"]
    assert all(len(cu) > 3 for cu in mix.samples)  # several documents a sample
    # the planner's estimate traces without the data, and times the step on it
    from megatron_lc.planning.estimate import Machine, estimate

    e = estimate(cfg, Machine(num_gpus=2, device="cpu", reserve_gib=0.0))
    assert prefix in e.time.packed["document_lengths"] and "assumed" not in e.time.packed["document_lengths"]


def test_the_report_names_the_assumed_mix_and_the_imbalance():
    from megatron_lc.planning.report import packed_lines

    t = predict(_cfg("--packing", "documents", "--cp-comm-type", "p2p"), 8, H100, family="fa3")
    text = "\n".join(packed_lines(t))
    assert "assumed length mix" in text and "bench/bench_packing.py" in text
    assert f"--cp-document-layout split: slowest rank's pairs over the mean {t.packed['imbalance_median']:.2f}x" \
        in text
    assert packed_lines(predict(_cfg(), 8, H100)) == []


def test_auto_fit_prices_each_document_layout_on_a_ring_and_its_command_carries_the_fastest():
    from megatron_lc.planning.autofit import document_layout_flags, fastest_document_layout
    from megatron_lc.planning.autofit_report import with_document_layout
    from megatron_lc.planning.timing import TimeModel

    model = TimeModel(H100, 8, "fa3")
    ring = _cfg("--packing", "documents", "--cp-comm-type", "p2p", "--cp-document-layout", "sequence", *STACK)
    best = fastest_document_layout(model, ring, 8)
    each = {layout: model.predict(_cfg("--packing", "documents", "--cp-comm-type", "p2p", "--cp-document-layout",
                                       layout, *STACK), 8).step_s for layout in ("sequence", "split", "local")}
    assert best.step_s == min(each.values()) < each["sequence"]
    assert best.packed["document_layout"] == min(each, key=each.get)
    command = ["torchrun", "-m", "megatron_lc.train", "--cp-document-layout", "sequence", "--bf16"]
    assert with_document_layout(command, best) == ["torchrun", "-m", "megatron_lc.train", "--bf16",
                                                   "--cp-document-layout", best.packed["document_layout"]]
    untied = fastest_document_layout(model, _cfg("--packing", "documents", "--cp-impl", "untied_ulysses"), 8)
    assert document_layout_flags(untied) == [] and document_layout_flags(predict(_cfg(), 8, H100)) == []
