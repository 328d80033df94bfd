"""Ring attention: its schedule covers causal attention exactly once, and its kernel
matches full-sequence attention (outputs and gradients) in multi-process gloo runs (one launch per world size)."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_lc.attention.kernels import KERNELS, attention
from megatron_lc.attention.varlen import segment_pairs
from megatron_lc.attention.ring import DocumentRingSchedule, RingAttention, RingSchedule
from megatron_lc.context_layout import ContextLayout, context_layout_from_flags
from megatron_lc.memory.tiling import tile_bounds
from megatron_lc.parallel_state import ParallelDims, ParallelState
from tests.exactness import checks_that_ran


def _positions(layout: ContextLayout, S: int, ring_rank: int, cu=None) -> list[int]:
    """Sequence positions of a ring rank's rows, in row order (its all-to-all ranks' ranges back to back)."""
    ranks = range(ring_rank * layout.a2a_size, (ring_rank + 1) * layout.a2a_size)
    return [p for c in ranks for a, b in layout.token_ranges(S, c, cu) for p in range(a, b)]


@pytest.mark.parametrize("a2a,ring,S", [(1, 2, 16), (1, 4, 32), (2, 2, 16), (3, 2, 24), (2, 3, 24), (4, 1, 16)])
def test_token_ranges_partition_the_sequence_evenly(a2a, ring, S):
    layout = ContextLayout(a2a, ring)
    held = [[p for a, b in layout.token_ranges(S, c) for p in range(a, b)] for c in range(layout.cp_size)]
    assert sorted(itertools.chain(*held)) == list(range(S))
    assert {len(h) for h in held} == {S // layout.cp_size}
    if ring > 1:  # ring rank r holds chunks r and 2R-1-r, in that order
        C = S // (2 * ring)
        for r in range(ring):
            assert _positions(layout, S, r) == [*range(r * C, (r + 1) * C), *range((2 * ring - 1 - r) * C,
                                                                                     (2 * ring - r) * C)]


def _bench_mix_samples(S: int, count: int) -> list[tuple[int, ...]]:
    from bench.bench_packing import realistic_lengths
    from megatron_lc.data.packing import pack_epoch

    lengths = realistic_lengths(20 * count * max(1, S // 3000))
    lengths = lengths[lengths <= S]
    packed = pack_epoch(lengths, S)
    out = []
    for k in range(count):
        docs = lengths[packed["documents"][packed["sample_starts"][k]:packed["sample_starts"][k + 1]]]
        cu = [0, *itertools.accumulate(int(n) for n in docs)]
        out.append(tuple(cu + ([S] if cu[-1] < S else [])))
    return out


@pytest.mark.parametrize("S", [32768, 262144])
def test_document_cuts_balance_ring_ranks_on_the_fine_tuning_mix(S):
    """bench_packing's length mix packed into samples: every ring rank holds exactly S/R tokens, every position
    once; `split` and `local` give the slowest ring rank at most 1.05x the mean attention pairs on every sample
    (the head/tail split of each rank's cut rows makes up for the whole documents' uneven tokens), `local`
    keeping its whole documents off the ring on a few ranks; `sequence` does not."""
    from megatron_lc.context_layout import packed_rank_work

    samples = _bench_mix_samples(S, 9)
    for R in (2, 4, 8, 16, 32, 64):
        medians = {}
        for documents in ("sequence", "split", "local"):
            layout = ContextLayout(1, R, documents)
            ratios = []
            for cu in samples:
                held = sorted(p for r in range(R) for a, b in layout.token_ranges(S, r, cu) for p in range(a, b))
                assert held == list(range(S))
                assert {sum(b - a for a, b in layout.token_ranges(S, r, cu)) for r in range(R)} == {S // R}
                pairs = [w.pairs for w in packed_rank_work(layout, cu, S)]
                assert sum(pairs) == sum((b - a) * (b - a + 1) // 2 for a, b in zip(cu, cu[1:]))
                ratios.append(max(pairs) * R / sum(pairs))
            medians[documents] = sorted(ratios)[len(ratios) // 2]
            if documents != "sequence":
                assert max(ratios) <= 1.05, (R, documents, ratios)
            if documents == "local" and R <= 4:  # (ranks of a few thousand tokens cut even 1.5K documents)
                sent = [layout.sample_cut(S, cu).sent_rows for cu in samples]
                assert sorted(sent)[len(sent) // 2] < S // R, "whole documents stay home"
        assert medians["sequence"] > 1.1, (R, medians)


def test_cut_points_follow_the_slots_within_a_row_and_never_fall_back():
    """Every slot gets exactly its rows, every piece is >= 0, and each document's cut points lie within two rows of
    its proportional ones (where its pieces' work is reckoned; one unless an earlier point rounded up holds it),
    not a slot's whole rounding on one document (up to a row per document in the sample)."""
    import random

    from megatron_lc.context_layout import _cut_points

    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.choice([1, 3, 40, 700, 8054, 20000]) for _ in range(rng.randint(1, 30))]
        total = sum(lengths)
        slots, left = [], total
        for _ in range(2 * rng.choice([2, 8, 64]) - 1):
            slots.append(rng.randint(0, left // 4))
            left -= slots[-1]
        slots.append(left)
        points = _cut_points(lengths, slots)
        boundary = [sum(slots[:j]) for j in range(len(slots) + 1)]
        for j, b in enumerate(boundary):
            assert sum(p[j] for p in points) == b
        for n, p in zip(lengths, points):
            assert p[0] == 0 and p[-1] == n and all(y >= x for x, y in zip(p, p[1:]))
            assert all(abs(x - n * b / total) < 2 for x, b in zip(p, boundary)), (n, p)


def test_layout_refuses_lengths_it_cannot_cut_naming_the_flag():
    with pytest.raises(ValueError, match="--seq-length 20 is not divisible by 12"):
        ContextLayout(3, 2).check(20)
    with pytest.raises(ValueError, match="--hierarchical-context-parallel-sizes 2 2: the product"):
        context_layout_from_flags(8, "a2a+p2p", (2, 2))
    with pytest.raises(ValueError, match="needs --hierarchical-context-parallel-sizes"):
        context_layout_from_flags(4, "a2a+p2p", None)
    with pytest.raises(ValueError, match="--cp-comm-type 'ring'"):
        context_layout_from_flags(4, "ring")
    assert context_layout_from_flags(4, "p2p") == ContextLayout(1, 4)
    assert context_layout_from_flags(4, "a2a+p2p", [2, 2]).comm_type == "a2a+p2p"


SAMPLES_OF_DOCUMENTS = {
    "uneven": None,  # random cuts: one document longer than a chunk, one of a single token
    "one document": [[1]],
    "all fit one rank": [[3, 2, 4, 1, 5, 3, 2, 4, 1, 5, 3, 2, 4, 1, 5, 3, 2, 4, 1, 5, 3, 2, 4, 1]],
    "longer than a rank's share": [[1, 70, 2, 6, 1, 4]],
}


def _sample_boundaries(name: str, ring: int, S: int, B: int) -> list[int]:
    g = torch.Generator().manual_seed(ring)
    cu = [0]
    for b in range(B):
        if SAMPLES_OF_DOCUMENTS[name] is None:
            cuts = sorted({int(x) for x in torch.randint(1, S, (4,), generator=g)} | {5, 6})
        else:  # lengths as shares of S (the last one takes the rest)
            shares = SAMPLES_OF_DOCUMENTS[name][0]
            cuts, at = [], 0
            for n in shares[:-1]:
                at += max(1, n * S // sum(shares))
                if at < S:
                    cuts.append(at)
            cuts = sorted(set(cuts))
        cu += [b * S + c for c in cuts] + [(b + 1) * S]
    return cu


@pytest.mark.parametrize("documents", ["sequence", "split", "local"])
@pytest.mark.parametrize("samples", list(SAMPLES_OF_DOCUMENTS))
@pytest.mark.parametrize("ring", [2, 3, 4])
def test_schedule_attends_every_causal_same_document_pair_exactly_once(ring, samples, documents):
    S, B = 24 * ring, 2
    layout = ContextLayout(1, ring, documents)
    cu = _sample_boundaries(samples, ring, S, B)
    per_sample = [tuple(c - b * S for c in cu if b * S <= c <= (b + 1) * S) for b in range(B)]
    doc = lambda p: max(i for i, c in enumerate(cu) if c <= p)  # noqa: E731
    want = {(b * S + i, b * S + j) for b in range(B) for i in range(S) for j in range(i + 1) if doc(b * S + i) ==
            doc(b * S + j)}
    seen = []
    kind = RingSchedule if documents == "sequence" else DocumentRingSchedule
    for r in range(ring):
        schedule = kind(layout, S, tuple(cu), r)
        rows = [b * S + p for b in range(B) for p in _positions(layout, S, r, per_sample[b])]
        assert len(rows) == B * S // ring, "every ring rank holds S/R tokens of each sample"
        assert schedule.sent_rows == len(rows) if documents == "sequence" else schedule.sent_rows <= len(rows)
        for kv in range(ring):
            kv_rows = [b * S + p for b in range(B) for p in _positions(layout, S, kv, per_sample[b])]
            pairs = ([schedule.own_block()] if kv == r else []) + schedule.cross_pairs(kv)
            if kv != r:  # only rows that travel are attended from afar
                assert all(pair.k_rows[1] <= schedule.sent_rows for pair in pairs)
            for pair in pairs:
                if pair.cu_k is not None:  # no call, and no segment, pairs pieces that share no document
                    for qa, qb, ka, kb in segment_pairs(pair.cu_q, pair.cu_k, False):
                        assert qb > qa and kb > ka
                        assert doc(rows[pair.q_rows[0] + qa]) == doc(kv_rows[pair.k_rows[0] + ka])
                (a, _), (c, _) = pair.q_rows, pair.k_rows
                for qa, qb, ka, kb in segment_pairs(pair.cu_q, pair.cu_k, pair.cu_k is None):
                    for i in range(qa, qb):
                        for j in range(ka, kb):
                            if pair.cu_k is None and j > i:
                                continue  # causal inside the own block
                            seen.append((rows[a + i], kv_rows[c + j]))
    assert len(seen) == len(set(seen)), "a pair attended twice"
    assert set(seen) == want


# --- multi-process: the kernel against full-sequence attention ------------------------------------


def _full_and_local(S, B, H, Hkv, d, layout, cp_rank, seed=0):
    """q, k, v of B samples [B, S, heads, d]; boundaries (a sample of 5 documents, one of single tokens and a long
    one); the rank's rows of
    each sample [B, S/cp] (they differ by sample when the ring cuts by documents)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, h, d, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv))
    cu, idx = [0], []
    for b in range(B):
        cuts = (3, 5, S // 2 + 1, S - 2) if b % 2 == 0 else tuple(range(1, S // 2))  # tokens alone, one long
        cu += [b * S + c for c in cuts] + [(b + 1) * S]
        idx.append([p for a, e in layout.token_ranges(S, cp_rank, (0, *cuts, S)) for p in range(a, e)])
    return (q, k, v), tuple(cu), torch.tensor(idx)


def _rows(t, idx):
    """Each sample's rows `idx[b]` of t [B, S, ...]."""
    return t[torch.arange(t.shape[0]).unsqueeze(1), idx]


def _check_ring_kernel(rank, world, overlap, kv_grads="overlapped", documents="sequence"):
    torch.manual_seed(0)
    S, B, H, Hkv, d = 32, 2, 4, 2, 8
    layout = ContextLayout(1, world, documents)
    pstate = ParallelState(ParallelDims(world, cp=world, cp_ring=world))
    # In place: 5 rows of [Hkv, d] fp64 per rotation chunk, so a rotation takes several chunks, asked of the tile
    # policy (the planner's runs representative chunks through it).
    asked = []

    def recording_bounds(rows, num_tiles):
        asked.append((rows, num_tiles))
        return tile_bounds(rows, num_tiles)

    ring = RingAttention(KERNELS["reference"], pstate.ring_group, layout, S, overlap=overlap, kv_grads=kv_grads,
                         rotation_chunk_bytes=5 * Hkv * d * 8, tile_bounds=recording_bounds).as_kernel()
    (q, k, v), cu, idx = _full_and_local(S, B, H, Hkv, d, layout, pstate.cp_rank)
    if documents == "local":  # the single tokens stay home
        assert DocumentRingSchedule(layout, S, cu, rank).sent_rows < B * S // world
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*(t.flatten(0, 1) for t in full), cu, KERNELS["reference"]).unflatten(0, (B, S))
    dout = torch.randn_like(out)
    out.backward(dout)
    local = [_rows(t, idx).clone().requires_grad_() for t in (q, k, v)]
    got = attention(*(t.flatten(0, 1) for t in local), cu, ring).unflatten(0, idx.shape)
    got.backward(_rows(dout, idx))
    torch.testing.assert_close(got, _rows(out, idx).detach(), rtol=1e-10, atol=1e-10)
    for mine, ref in zip(local, full):
        torch.testing.assert_close(mine.grad, _rows(ref.grad, idx), rtol=1e-10, atol=1e-10)

    if kv_grads == "in_place":
        assert asked and all(n == -(-rows // 5) and n > 1 for rows, n in asked)  # chunks of at most 5 rows
    else:
        assert asked == []
    if kv_grads == "in_place":  # bit for bit what the overlapped accumulators give
        overlapped = RingAttention(KERNELS["reference"], pstate.ring_group, layout, S).as_kernel()
        again = [_rows(t, idx).clone().requires_grad_() for t in (q, k, v)]
        attention(*(t.flatten(0, 1) for t in again), cu, overlapped).backward(_rows(dout, idx).flatten(0, 1))
        for mine, theirs in zip(local, again):
            assert torch.equal(mine.grad, theirs.grad)


RING_KERNEL_CASES = [
    (2, True, "overlapped", "sequence"), (4, True, "overlapped", "sequence"), (4, False, "overlapped", "sequence"),
    (2, True, "in_place", "sequence"), (4, True, "in_place", "sequence"),
    (4, True, "overlapped", "split"), (2, True, "overlapped", "local"), (4, True, "in_place", "local")]
"""world, overlap, kv_grads, documents"""


@pytest.mark.parametrize("world,overlap,kv_grads,documents", RING_KERNEL_CASES)
def test_ring_kernel_matches_full_sequence_attention(world, overlap, kv_grads, documents, checked):
    assert f"ring-kernel-{world}-{overlap}-{kv_grads}-{documents}" in checked


def _check_cpu_flash_in_ring(rank, world, documents):
    """torch's CPU flash kernel (fp32) through the ring's unmasked calls (under a document cut, calls of many
    segments), against the fp64 reference."""
    torch.manual_seed(0)  # the same output gradient on every rank
    S, B, H, Hkv, d = 32, 2, 4, 1, 8
    layout = ContextLayout(1, world, documents)
    pstate = ParallelState(ParallelDims(world, cp=world, cp_ring=world))
    ring = RingAttention(KERNELS["cpu_flash"], pstate.ring_group, layout, S).as_kernel()
    (q, k, v), cu, idx = _full_and_local(S, B, H, Hkv, d, layout, pstate.cp_rank, seed=1)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*(t.flatten(0, 1) for t in full), cu, KERNELS["reference"]).unflatten(0, (B, S))
    dout = torch.randn_like(out)
    out.backward(dout)
    local = [_rows(t, idx).float().requires_grad_() for t in (q, k, v)]
    got = attention(*(t.flatten(0, 1) for t in local), cu, ring)
    got.backward(_rows(dout, idx).flatten(0, 1).float())
    torch.testing.assert_close(got.double(), _rows(out, idx).flatten(0, 1).detach(), rtol=1e-5, atol=1e-5)
    for mine, ref in zip(local, full):
        torch.testing.assert_close(mine.grad.double(), _rows(ref.grad, idx), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("documents", ["sequence", "split"])
def test_cpu_flash_kernel_runs_in_the_ring(documents, checked):
    assert f"cpu-flash-{documents}" in checked


def test_column_blocks_of_one_buffer_travel_as_that_buffer():
    """k and v side by side in one buffer (as Untied Ulysses' all-to-all leaves them) are sent as it, uncopied;
    anything else is not taken for such a buffer."""
    from megatron_lc.attention.ring import _side_by_side

    packed = torch.arange(2 * 6 * 8, dtype=torch.float32).view(2, 6, 8)  # [B, s, k columns | v columns]
    k, v = (packed[..., cols].reshape(-1, 1, 4) for cols in (slice(0, 4), slice(4, 8)))
    base = _side_by_side((k, v))
    assert base is not None and base.data_ptr() == packed.data_ptr() and base.shape == (12, 8)
    assert torch.equal(base[:, :4].reshape(k.shape), k) and torch.equal(base[:, 4:].reshape(v.shape), v)
    assert _side_by_side((v, k)) is None, "blocks out of order"
    assert _side_by_side((k, v.clone())) is None, "another buffer"
    assert _side_by_side((k.contiguous(), v.contiguous())) is None, "contiguous tensors travel as they are"
    wide = torch.zeros(12, 10)
    assert _side_by_side((wide[:, :4].view(12, 1, 4), wide[:, 4:8].view(12, 1, 4))) is None, "columns left over"


def _check_split_kernel_state_in_ring(rank, world, S, documents, splitting_ranks):
    """The memory-efficient kernel (stand-in operators, its state contract: one philox pair per call, and one
    block's call split into several by its segments) in the ring, against full-sequence attention: each call's
    backward gets its own forward's state."""
    import functools

    from megatron_lc.attention.kernels import Kernel, sdpa_efficient_backward, sdpa_efficient_forward
    from tests.attention.kernel_contracts import EfficientOpsOnAnySegments

    torch.manual_seed(0)
    B, H, Hkv, d = len(documents), 2, 1, 8
    layout = ContextLayout(1, world)
    pstate = ParallelState(ParallelDims(world, cp=world, cp_ring=world))
    standin = EfficientOpsOnAnySegments()
    efficient = Kernel("sdpa_efficient", functools.partial(sdpa_efficient_forward, ops=standin.ops),
                       functools.partial(sdpa_efficient_backward, ops=standin.ops))
    ring = RingAttention(efficient, pstate.ring_group, layout, S)
    cu = [0]
    for b, lengths in enumerate(documents):
        for n in lengths:
            cu.append(cu[-1] + n)
        assert cu[-1] == (b + 1) * S
    cu = tuple(cu)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B * S, h, d, generator=g) for h in (H, Hkv, Hkv))
    full = [t.double().requires_grad_() for t in (q, k, v)]
    out = attention(*full, cu, KERNELS["reference"])
    dout = torch.randn_like(out)
    out.backward(dout)
    idx = torch.tensor([b * S + p for b in range(B) for a, e in layout.token_ranges(S, pstate.cp_rank)
                        for p in range(a, e)])
    local = [t[idx].clone().requires_grad_() for t in (q, k, v)]
    got = attention(*local, cu, ring.as_kernel())
    got.backward(dout[idx].float())
    schedule = RingSchedule(layout, S, cu, pstate.cp_rank)
    ring_calls = 1 + sum(len(schedule.cross_pairs(r)) for r in range(world))
    assert (len(standin.forwards) > ring_calls) == (rank in splitting_ranks), "which ranks split a call"
    standin.check_all_used()
    torch.testing.assert_close(got.double(), out[idx].detach(), rtol=1e-5, atol=1e-5)
    for mine, ref in zip(local, full):
        torch.testing.assert_close(mine.grad.double(), ref.grad[idx], rtol=1e-4, atol=1e-5)


def test_a_kernel_that_splits_a_block_into_calls_gets_each_calls_state_back(checked):
    """Uneven documents: one long, then many of one token (more segments than one memory-efficient call takes),
    then one crossing chunks; a second sample of two documents."""
    assert "split-calls" in checked


def test_documents_of_the_reported_ring_crash_train_exactly(checked):
    """The reported case: documents [7000, 10 x 100, rest] at 32K on 2 ranks under the memory-efficient kernel
    (the own block of 7000 + 10 x 100 + 192 and 8192 rows splits into two calls)."""
    assert "reported-crash" in checked


def _checks() -> dict[int, dict]:
    """world size -> name -> (check, its arguments after (rank, world))."""
    checks = {2: {}, 4: {}}
    for world, overlap, kv_grads, documents in RING_KERNEL_CASES:
        checks[world][f"ring-kernel-{world}-{overlap}-{kv_grads}-{documents}"] = (
            _check_ring_kernel, (overlap, kv_grads, documents))
    for documents in ("sequence", "split"):
        checks[2][f"cpu-flash-{documents}"] = (_check_cpu_flash_in_ring, (documents,))
    checks[2]["split-calls"] = (_check_split_kernel_state_in_ring, (512, [[40] + [1] * 200 + [512 - 240],
                                                                          [300, 512 - 300]], (0, 1)))
    S = 32768
    checks[2]["reported-crash"] = (_check_split_kernel_state_in_ring, (S, [[7000] + [100] * 10 + [S - 8000]], (0,)))
    return checks


@pytest.fixture(scope="module")
def checked():
    """Every gloo check of this file (`_checks`), one launch per world size: the names of those that ran."""
    return checks_that_ran(_checks())
