"""The memory stack switched on changes neither loss nor gradients: one process, and FSDP + CP."""

import dataclasses

import pytest
import torch

from megatron_lc.models.llama import build_model, get_config
from megatron_lc.models.llama.parallelize import ParallelizeOptions, apply_memory_stack
from megatron_lc.parallel_state import ParallelDims, ParallelState
from megatron_lc.training.step import forward_backward
from megatron_lc.errors import ConfigError
from tests.helpers import make_batch, parallelize_options
from tests.exactness import BATCH, CPU, check_against_reference, checks_that_ran

STACKS = {
    "full": parallelize_options(recompute_granularity="full"),
    "selective": parallelize_options(recompute_granularity="selective"),
    "full+offload": parallelize_options(recompute_granularity="full", offload_mode="prefetch"),
    "tiled-mlp": parallelize_options(mlp_tiles=3),
    "tiled-loss": parallelize_options(loss_tiles=5),
    "everything": parallelize_options(recompute_granularity="full", offload_mode="prefetch", mlp_tiles=3,
                                     loss_tiles=5),
    "everything-fetch-on-demand": parallelize_options(recompute_granularity="full", offload_mode="on_demand",
                                                      mlp_tiles=3, loss_tiles=5),
    "everything-prefetch-early": parallelize_options(recompute_granularity="full", offload_mode="early",
                                                     mlp_tiles=3, loss_tiles=5),
}


def _loss_and_grads(opts):
    config = get_config("debug")
    model = build_model(config, device="cpu", seed=0)
    apply_memory_stack(model, opts, CPU)
    batch, _ = make_batch(**BATCH)
    result = forward_backward(model, [batch], ParallelState(ParallelDims(world_size=1)), CPU.accelerator)
    return result.loss, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_memory_technique_matches_plain_model_in_one_process(stack):
    ref_loss, ref_grads = _loss_and_grads(ParallelizeOptions())
    loss, grads = _loss_and_grads(STACKS[stack])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("mode", ["on_demand", "prefetch", "early"])
def test_offload_requires_full_recompute(mode):
    with pytest.raises(ConfigError, match=f"--offload-mode {mode} .* needs --recompute-granularity full"):
        parallelize_options(recompute_granularity="selective", offload_mode=mode).validate()


WHOLE_STACK_CASES = {"cp2": (2, "everything"), "cp4": (4, "everything"),
                     "cp2-fetch-on-demand": (2, "everything-fetch-on-demand"),
                     "cp2-prefetch-early": (2, "everything-prefetch-early"), "cp2-selective": (2, "selective")}
"""name: (world = cp, stack) of the FSDP + Ulysses checks."""


@pytest.fixture(scope="module")
def checked():
    """Every gloo check of this file (`_checks`), one launch per world size: the names of those that ran."""
    return checks_that_ran(_checks())


@pytest.mark.parametrize("name", ["cp2", "cp4", "cp2-fetch-on-demand", "cp2-prefetch-early"])
def test_whole_stack_with_fsdp_and_ulysses_matches_single_process(name, checked):
    assert name in checked


def test_selective_recompute_with_fsdp_and_ulysses_matches_single_process(checked):
    assert "cp2-selective" in checked


# --- sparse offload: every k-th block input kept, the others recomputed from it ------------------------

SPARSE_CONFIG = dataclasses.replace(get_config("debug"), num_layers=4)
"""Layers 0-2 offload (the last keeps its input on the accelerator): k = 2 makes segments {0, 1}, {2};
k = 3 makes {0, 1, 2}: a replay of two blocks, the first of them gathered and sharded again."""


def _sparse(k, **more):
    more.setdefault("offload_mode", "prefetch")
    return parallelize_options(recompute_granularity="full", offload_every_k_layers=k, **more)


def _sparse_loss_and_grads(opts):
    model = build_model(SPARSE_CONFIG, device="cpu", seed=0)
    offload = apply_memory_stack(model, opts, CPU)
    batch, _ = make_batch(**BATCH)
    result = forward_backward(model, [batch], ParallelState(ParallelDims(world_size=1)), CPU.accelerator)
    return result.loss, {n: p.grad for n, p in model.named_parameters()}, offload


@pytest.mark.parametrize("k, prefetch, slots", [(2, True, 2), (2, False, 2), (3, True, 1), (7, True, 1)])
def test_sparse_offload_is_bit_identical_to_keeping_every_input_with_k_times_fewer_on_the_host(k, prefetch, slots):
    ref_loss, ref_grads, _ = _sparse_loss_and_grads(ParallelizeOptions())
    dense_loss, dense_grads, dense = _sparse_loss_and_grads(_sparse(1, mlp_tiles=3, loss_tiles=5))
    loss, grads, offload = _sparse_loss_and_grads(_sparse(k, offload_mode="prefetch" if prefetch else "on_demand",
                                                          mlp_tiles=3, loss_tiles=5))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert torch.equal(loss, dense_loss)  # the replay is the forward again: not close, equal
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
        assert torch.equal(g, dense_grads[n]), n
    per_input = dense.host_bytes_peak // 3
    assert offload.host_bytes_peak == slots * per_input and offload.host_bytes_in_use == 0
    assert offload.host_bytes_reserved == slots * per_input


def test_sparse_offload_requires_offload():
    with pytest.raises(ConfigError, match="--offload-every-k-layers .* needs --offload-mode"):
        parallelize_options(recompute_granularity="full", offload_every_k_layers=2).validate()
    with pytest.raises(ValueError, match="--offload-every-k-layers 0: expected an integer >= 1"):
        _sparse(0).validate()


SPARSE_CASES = {  # name: (cp, cp_ring, options)
    "ulysses-cp2": (2, 1, _sparse(2, mlp_tiles=3, loss_tiles=5)),
    "untied-cp2-k3": (2, 1, _sparse(3, cp_impl="untied_ulysses", heads_per_stage=4, mlp_tiles=3, loss_tiles=5)),
    "ring-cp2": (2, 2, _sparse(2, mlp_tiles=3, loss_tiles=5, offload_mode="on_demand")),
    "fsdp-dp2-k3": (1, 1, _sparse(3, loss_tiles=5)),
}


def _sparse_cases(rank, world):
    for name, (cp, ring, opts) in SPARSE_CASES.items():
        try:
            check_against_reference(rank, world, SPARSE_CONFIG, cp, opts, BATCH, 2, ring)
        except Exception as e:
            raise AssertionError(f"case {name}: {e}") from e


def test_sparse_offload_with_fsdp_and_every_context_parallel_backend_matches_single_process(checked):
    """2 ranks, one after the other in the same processes: Ulysses, Untied Ulysses (norm and o_proj folded into
    it), ring, FSDP alone; with tiled MLP and loss, prefetch and fetch on demand; two optimizer steps each."""
    assert "sparse-offload" in checked


# --- kept attention: the recompute takes the forward's attention output and lse, runs no attention forward ----


def _keep(offload=True, **more):
    mode = more.pop("offload_mode", "prefetch" if offload else "none")
    return parallelize_options(recompute_granularity="full", offload_mode=mode, keep_attention_output=True, **more)


KEEP_STACKS = {  # name: (options, host slots of attention outputs: the offloaded layers, 3 of 4)
    "on-the-gpu": (_keep(offload=False), 0),
    "offloaded": (_keep(), 3),
    "offloaded-everything-on-demand": (_keep(offload_mode="on_demand", mlp_tiles=3, loss_tiles=5), 3),
    "sparse-k2-everything": (_keep(offload_every_k_layers=2, mlp_tiles=3, loss_tiles=5), 3),
    # The first 2 blocks keep theirs (--keep-attention-output-layers 2): 2 host slots, the others recompute.
    "offloaded-first-2-of-4": (_keep(keep_attention_layers=2, mlp_tiles=3, loss_tiles=5), 2),
}


def _counting_forwards(monkeypatch):
    """Count the attention kernel's forward calls (the local backend's kernel, wrapped)."""
    from megatron_lc.attention import local
    from megatron_lc.attention.kernels import Kernel

    calls = []
    real = local.LocalAttention.__call__

    def call(self, *args):
        if not self.kernel.name.startswith("counted-"):
            inner = self.kernel
            self.kernel = Kernel("counted-" + inner.name, lambda *a, **k: (calls.append(1), inner.forward(*a, **k))[1],
                                 inner.backward)
        return real(self, *args)

    monkeypatch.setattr(local.LocalAttention, "__call__", call)
    return calls


@pytest.mark.parametrize("stack", sorted(KEEP_STACKS))
def test_kept_attention_is_bit_identical_to_recomputing_it_and_runs_each_attention_forward_once(stack, monkeypatch):
    opts, attention_slots = KEEP_STACKS[stack]
    calls = _counting_forwards(monkeypatch)
    ref_loss, ref_grads, _ = _sparse_loss_and_grads(ParallelizeOptions())
    same = dataclasses.replace(opts, memory=dataclasses.replace(opts.memory, keep_attention_output=False,
                                                                keep_attention_layers=None))
    recomputed_loss, recomputed_grads, recomputing = _sparse_loss_and_grads(same)
    replays = 1 if opts.memory.offload_every_k_layers == 2 else 0  # segments {0, 1}, {2}: layer 1 replays block 0
    assert len(calls) == 4 + 4 + 4 + replays  # the reference; the forward and the recompute of every block
    del calls[:]
    loss, grads, offload = _sparse_loss_and_grads(opts)
    keeping = opts.memory.kept_attention_layers(4)
    assert len(calls) == 4 + (4 - keeping) + replays  # the forward, the recompute of blocks that do not keep
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert torch.equal(loss, recomputed_loss)  # the kept tensors are those the recompute would make: equal
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
        assert torch.equal(g, recomputed_grads[n]), n
    if offload is not None:  # each offloaded layer's output [B*S, H, d] and fp32 lse [H, B*S] on the host too
        c, tokens = SPARSE_CONFIG, BATCH["num_samples"] * BATCH["seq_length"]
        kept = attention_slots * tokens * c.num_attention_heads * (c.kv_channels + 1) * 4
        assert offload.host_bytes_peak == recomputing.host_bytes_peak + kept
        assert offload.host_bytes_in_use == 0


def test_kept_attention_requires_full_recompute():
    with pytest.raises(ValueError, match="--keep-attention-output .* needs --recompute-granularity full"):
        parallelize_options(recompute_granularity="selective", keep_attention_output=True).validate()


KEEP_CASES = {  # name: (cp, cp_ring, options)
    "ulysses-cp2-sparse-k2-everything": (2, 1, _keep(offload_every_k_layers=2, mlp_tiles=3, loss_tiles=5)),
    "untied-cp2": (2, 1, _keep(cp_impl="untied_ulysses", heads_per_stage=4, mlp_tiles=3, loss_tiles=5)),
    "ring-cp2-on-the-gpu": (2, 2, _keep(offload=False, mlp_tiles=3, loss_tiles=5)),
    "untied-cp2-first-3-of-4": (2, 1, _keep(cp_impl="untied_ulysses", heads_per_stage=4, keep_attention_layers=3)),
}


def _keep_cases(rank, world):
    from megatron_lc.memory.kept_attention import KeptAttention

    taken, take = [], KeptAttention.take
    KeptAttention.take = lambda self: (taken.append(self.layer_idx), take(self))[1]
    try:
        for name, (cp, ring, opts) in KEEP_CASES.items():
            try:
                taken.clear()
                check_against_reference(rank, world, SPARSE_CONFIG, cp, opts, BATCH, 2, ring)
                keeping = list(range(opts.memory.kept_attention_layers(4)))
                assert sorted(taken) == sorted(keeping * 2), taken  # each keeping block's recompute, both steps
            except Exception as e:
                raise AssertionError(f"case {name}: {e}") from e
    finally:
        KeptAttention.take = take


def test_kept_attention_with_fsdp_and_every_context_parallel_backend_matches_single_process(checked):
    """2 ranks (FSDP over the cp ranks), case after case in the same processes: Ulysses with sparse offload k = 2,
    Untied Ulysses (norm and o_proj folded into it) offloaded, ring with the attention kept on the GPU; tiled MLP
    and loss; two optimizer steps each. Every block's recompute takes its kept attention."""
    assert "kept-attention" in checked


# --- kept attention read by sparse offload's replays: inputs rebuilt by projections, norms and MLP only --------

def _replaying(k, **more):
    return _keep(offload_every_k_layers=k, replay_kept_attention=True, **more)


REPLAY_STACKS = {  # 4 layers, 3 offloaded: k = 3 makes one segment {0, 1, 2}, k = 2 makes {0, 1}, {2}
    "k3-everything": _replaying(3, mlp_tiles=3, loss_tiles=5),
    "k2-on-demand": _replaying(2, offload_mode="on_demand"),
    "k3-early": _replaying(3, offload_mode="early", loss_tiles=5),
    # Only block 0 keeps its attention: its replays read it, block 1's replay computes it.
    "k3-first-1-of-4": _replaying(3, keep_attention_layers=1, mlp_tiles=3),
}


@pytest.mark.parametrize("stack", sorted(REPLAY_STACKS))
def test_replays_reading_kept_attention_are_bit_identical_and_run_no_attention_forward(stack, monkeypatch):
    opts = REPLAY_STACKS[stack]
    calls = _counting_forwards(monkeypatch)
    ref_loss, ref_grads, _ = _sparse_loss_and_grads(ParallelizeOptions())
    computing = dataclasses.replace(opts, memory=dataclasses.replace(opts.memory, replay_kept_attention=False))
    del calls[:]
    same_loss, same_grads, same = _sparse_loss_and_grads(computing)
    keeping = opts.memory.kept_attention_layers(4)
    replays = computing.memory.replayed_attention_forwards(4)
    assert replays == opts.memory.sparse_offload(4).replayed_forwards > 0
    assert len(calls) == 4 + (4 - keeping) + replays
    del calls[:]
    loss, grads, offload = _sparse_loss_and_grads(opts)
    reading = replays - opts.memory.replayed_attention_forwards(4)  # replays of blocks that keep theirs
    assert reading == {"k3-everything": 3, "k3-early": 3, "k2-on-demand": 1, "k3-first-1-of-4": 2}[stack]
    assert len(calls) == 4 + (4 - keeping) + replays - reading
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert torch.equal(loss, same_loss)  # the kept output is the one the replay would compute: equal
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
        assert torch.equal(g, same_grads[n]), n
    # Reading a kept output leaves its host slot in place: the host holds what it held, and nothing after.
    assert offload.host_bytes_peak == same.host_bytes_peak and offload.host_bytes_in_use == 0


def test_replays_per_layer_count_each_layer_once_per_later_layer_of_its_segment():
    from megatron_lc.memory.stack import replays_per_layer, sparse_offload_counts

    assert replays_per_layer(7, 3) == [2, 1, 0, 2, 1, 0, 0]
    assert replays_per_layer(3, 1) == [0, 0, 0] and replays_per_layer(0, 4) == []
    for n, k in [(31, 3), (31, 4), (8, 8), (5, 2)]:
        assert sum(replays_per_layer(n, k)) == sparse_offload_counts(n, k).replayed_forwards


@pytest.mark.parametrize("more", [dict(offload_every_k_layers=2), dict(keep_attention_output=True),
                                  dict(keep_attention_output=True, offload_mode="none")])
def test_replaying_kept_attention_needs_kept_attention_and_sparse_offload(more):
    more.setdefault("offload_mode", "prefetch")
    opts = parallelize_options(recompute_granularity="full", replay_kept_attention=True, **more)
    with pytest.raises(ConfigError, match="--replay-kept-attention .* needs --keep-attention-output and "
                                          "--offload-every-k-layers > 1"):
        opts.validate()


def _parallel_step(rank, world, config, cp, ring, opts, batch_args):
    """One step's loss and full gradients of `opts` on this rank's share."""
    from tests.exactness import build_parallel_model, full
    from megatron_lc.testing import shard_batch

    batch, per_sample = make_batch(**batch_args)
    pstate = ParallelState(ParallelDims(world_size=world, cp=cp, cp_ring=ring))
    opts = dataclasses.replace(opts, seq_length=batch_args["seq_length"])
    model = build_parallel_model(config, pstate, opts, build_model(config, device="cpu", seed=0).state_dict())
    local = shard_batch(batch, per_sample, pstate.dp_rank, pstate.dp_size, pstate.cp_rank, cp, pstate.context_layout)
    result = forward_backward(model, [local], pstate, CPU.accelerator)
    return result.loss, {n: full(p.grad) for n, p in model.named_parameters()}


REPLAY_CASES = {  # name: (cp, cp_ring, options)
    "ulysses-cp2-k3-everything": (2, 1, _replaying(3, mlp_tiles=3, loss_tiles=5)),
    "untied-cp2-k3": (2, 1, _replaying(3, cp_impl="untied_ulysses", heads_per_stage=4, mlp_tiles=3)),
    "untied-lean-cp2-k2-first-2": (2, 1, _replaying(2, cp_impl="untied_ulysses", heads_per_stage=4,
                                                    untied_backward="lean", keep_attention_layers=2)),
    "ring-cp2-k3-on-demand": (2, 2, _replaying(3, offload_mode="on_demand", mlp_tiles=3, loss_tiles=5)),
    "fsdp-dp2-k3": (1, 1, _replaying(3, loss_tiles=5)),
}


def _replay_cases(rank, world, cases):
    from megatron_lc.memory.kept_attention import KeptAttention

    read, take = [], KeptAttention.take
    KeptAttention.take = lambda self: (read.append(self.layer_idx) if self.peek else None, take(self))[1]
    try:
        for name, (cp, ring, opts) in cases.items():
            read.clear()
            _replay_case(rank, world, name, cp, ring, opts)
            stack = opts.memory
            replays = stack.sparse_offload(4).replayed_forwards - stack.replayed_attention_forwards(4)
            assert len(read) == 3 * replays > 0, (name, read)  # the replays of two steps and of one more
    finally:
        KeptAttention.take = take


def _replay_case(rank, world, name, cp, ring, opts):
    try:
        check_against_reference(rank, world, SPARSE_CONFIG, cp, opts, BATCH, 2, ring)
        computing = dataclasses.replace(opts, memory=dataclasses.replace(opts.memory, replay_kept_attention=False))
        loss, grads = _parallel_step(rank, world, SPARSE_CONFIG, cp, ring, opts, BATCH)
        same_loss, same_grads = _parallel_step(rank, world, SPARSE_CONFIG, cp, ring, computing, BATCH)
        assert torch.equal(loss, same_loss)
        for n, g in grads.items():
            assert torch.equal(g, same_grads[n]), n
    except Exception as e:
        raise AssertionError(f"case {name}: {e}") from e


def test_replays_reading_kept_attention_with_fsdp_and_every_context_parallel_backend_match(checked):
    """2 ranks, case after case: Ulysses, Untied Ulysses (fast, and lean with only 2 blocks keeping), ring, FSDP
    alone; tiled MLP and loss; each equal to the reference over two optimizer steps, and bit for bit equal to the
    same stack whose replays compute their attention."""
    assert "replays" in checked


def test_replays_reading_kept_attention_with_all_to_all_inside_a_ring_match(checked):
    """4 ranks: all-to-all over 2 inside a ring of 2 (a2a+p2p), sparse offload k = 3, tiled MLP and loss."""
    assert "replays-a2a+p2p-cp4-k3" in checked


def _checks() -> dict[int, dict]:
    """world size -> name -> (check, its arguments after (rank, world))."""
    checks = {2: {}, 4: {}}
    for name, (world, stack) in WHOLE_STACK_CASES.items():
        checks[world][name] = (check_against_reference, (get_config("debug"), world, STACKS[stack], BATCH))
    checks[2].update({"sparse-offload": (_sparse_cases, ()), "kept-attention": (_keep_cases, ()),
                      "replays": (_replay_cases, (REPLAY_CASES,))})
    checks[4]["replays-a2a+p2p-cp4-k3"] = (_replay_cases, ({"a2a+p2p-cp4-k3": (4, 2, _replaying(3, mlp_tiles=3,
                                                                                                 loss_tiles=5))},))
    return checks
