"""--optimizer-cpu-offload: AdamW's master weights, moments and gradients on the host, its step there. On CPU the
arithmetic is the resident optimizer's, so runs with and without it are equal bit for bit; checkpoints are in one
layout, so either resumes the other's, at another world size too."""

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_lc.arguments import parse_config
from megatron_lc.errors import ConfigError
from megatron_lc.training import checkpointing
from megatron_lc.training.optim import HostAdamW
from megatron_lc.training.trainer import build_run, train, train_one_step
from tests.helpers import TRAIN_FLAGS, logged_losses, torchrun_train

OFFLOAD = ["--optimizer-cpu-offload"]
# Two micro-batches a step (gradients added on the host), clipping that acts (a small --clip-grad), weight decay.
FLAGS = TRAIN_FLAGS + ["--global-batch-size", "2", "--micro-batch-size", "1", "--clip-grad", "0.05",
                       "--weight-decay", "0.1", "--train-iters", "3"]


def _checkpoint_tensors(path, tmp_path, name):
    """Every tensor of a checkpoint (model and optimizer state), by key."""
    out = tmp_path / f"{name}.pt"
    dcp_to_torch_save(str(path), str(out))
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value
    walk("", {k: v for k, v in torch.load(out, weights_only=False).items() if k in ("model", "optim")})
    return flat


def _assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys() and any(".exp_avg_sq" in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_one_process_run_equals_the_resident_optimizer_bit_for_bit():
    resident, offloaded = build_run(parse_config(FLAGS)), build_run(parse_config(FLAGS + OFFLOAD))
    assert isinstance(offloaded.optimizer, HostAdamW) and not isinstance(resident.optimizer, HostAdamW)
    for step in (1, 2, 3):
        a, b = train_one_step(resident, step), train_one_step(offloaded, step)
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), step
        assert all(p.grad is None for p in offloaded.model.parameters())  # moved to the host, freed
        assert b["host_optimizer_gib"] == offloaded.optimizer.host_bytes() / 2**30 > 0
        assert b["host_optimizer_page_locked_gib"] == 0 and "host_optimizer_gib" not in a  # ordinary memory on CPU
    assert a["grad_norm"] > 0.05  # the clip acted
    for (name, p), q in zip(resident.model.named_parameters(), offloaded.model.parameters()):
        assert torch.equal(p, q), name
    masters = offloaded.optimizer.masters
    assert all(torch.equal(m, p) for m, p in zip(masters, offloaded.model.parameters()))
    moments = [resident.optimizer.state[p]["exp_avg_sq"] for p in resident.model.parameters()]
    assert all(torch.equal(m, offloaded.optimizer.inner.state[h]["exp_avg_sq"]) for m, h in zip(moments, masters))


def test_two_rank_runs_and_their_checkpoints_equal_the_resident_optimizer_bit_for_bit(tmp_path):
    """FSDP over 2 ranks with the stack auto-fit answers for llama-32b and llama3-70b on one node (ring cp with
    in-place kv gradients, full recompute, every second block input offloaded early, the attention outputs of the
    first blocks kept and read by the replays, tiled MLP and loss), scaled down: same losses and the same
    checkpoint, every tensor."""
    stack = ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "--ring-kv-grads", "in_place",
             "--num-layers", "4", "--recompute-granularity", "full", "--offload-mode", "early",
             "--offload-every-k-layers", "2", "--keep-attention-output", "--keep-attention-output-layers", "1",
             "--replay-kept-attention", "--tiled-mlp", "--tiled-mlp-tiles", "2", "--tiled-loss",
             "--tiled-loss-tiles", "3"]
    for name, extra in (("resident", []), ("offloaded", OFFLOAD)):
        torchrun_train(2, FLAGS + stack + extra + ["--save", name, "--log-dir", f"{name}_log"], tmp_path)
    assert logged_losses(tmp_path / "resident_log") == logged_losses(tmp_path / "offloaded_log")
    paths = [checkpointing.latest_checkpoint(tmp_path / name) for name in ("resident", "offloaded")]
    _assert_same_tensors(*(_checkpoint_tensors(p, tmp_path, n) for p, n in zip(paths, "ab")))


@pytest.mark.parametrize("first, then", [(OFFLOAD, []), ([], OFFLOAD)])
def test_a_checkpoint_resumes_with_or_without_offload_on_another_world_size(tmp_path, first, then):
    """2 ranks for two steps, resumed in one process for the third: the losses of one uninterrupted run."""
    whole = train(parse_config(FLAGS + ["--log-dir", str(tmp_path / "whole")]))
    torchrun_train(2, FLAGS + first + ["--save", "ckpt", "--exit-interval", "2", "--log-dir", "two"], tmp_path)
    rest = train(parse_config(FLAGS + then + ["--load", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "one")]))
    assert [m["step"] for m in rest] == [3]
    losses = logged_losses(tmp_path / "two") + [m["loss"] for m in rest]
    assert losses == pytest.approx([m["loss"] for m in whole], rel=1e-5)


def test_fsdp_cpu_offload_with_it_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="--optimizer-cpu-offload with --fsdp-cpu-offload"):
        parse_config(TRAIN_FLAGS + OFFLOAD + ["--fsdp-cpu-offload"]).validate(world_size=2)


def test_a_host_share_beyond_the_nodes_available_memory_is_refused_in_one_line_with_the_numbers(tmp_path):
    """llama3-70b's model states in one process (16 B x 70.6B parameters, 1,051.3 GiB) are more than this machine
    has; the same run with the optimizer on the GPU keeps nothing on the host and passes this check."""
    import subprocess
    import sys

    from megatron_lc.training.preflight import host_share_bytes, preflight, read_host_memory

    flags = ["--mock-data", "--model", "llama3-70b", "--seq-length", "64", "--device", "cpu"]
    assert host_share_bytes(parse_config(flags + OFFLOAD), 1) == (0, 70_553_706_496 * 16)
    assert host_share_bytes(parse_config(flags + OFFLOAD), 8)[1] == 70_553_706_496 // 8 * 16
    assert read_host_memory().usable() < 1051 * 2**30  # this test needs a machine of less
    preflight(parse_config(flags), 1)
    out = subprocess.run([sys.executable, "-m", "megatron_lc.train", *flags, *OFFLOAD, "--log-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "host memory: 1 process(es) on this node keep 1,051.3 GiB" in lines[0]
    assert "0.0 GiB of offloaded block inputs + 1,051.3 GiB of model states" in lines[0]


@pytest.fixture
def one_rank_mesh():
    """A one-rank gloo world and its mesh, in this process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _stepped_host_optimizer(mesh):
    """A host AdamW over two sharded parameters, after one step (its moments exist)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(shape), mesh, [Shard(0)])) for shape in ((4, 3), (5,))]
    optimizer = HostAdamW(params, torch.device("cpu"), False, lr=0.1, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for p in params:
        p.grad = torch.ones_like(p)
        optimizer.take_gradient(p)
    optimizer.step()
    return optimizer, {id(p): f"w{i}" for i, p in enumerate(params)}


def test_checkpoints_of_the_host_optimizer_read_and_fill_its_moments_where_they_are(one_rank_mesh, monkeypatch):
    """With the mesh's device type an accelerator's (here "meta", which holds no data), the state a save reads is
    the host moments themselves, and a load fills host tensors that become the moments: nothing is copied to the
    accelerator (torch's `DTensor.from_local` would move each to the mesh's device type)."""
    optimizer, names = _stepped_host_optimizer(one_rank_mesh)
    fresh, fresh_names = _stepped_host_optimizer(one_rank_mesh)
    fresh.inner.state.clear()  # as built, before any step: the load makes the moments
    monkeypatch.setattr(type(one_rank_mesh), "device_type", property(lambda mesh: "meta"))
    for empty in (False, True):
        state = optimizer.checkpoint_state(names, empty=empty)["state"]
        for p, master in zip(optimizer.params, optimizer.masters):
            for key in ("exp_avg", "exp_avg_sq"):
                shard = state[names[id(p)]][key]
                assert shard.shape == p.shape and shard.placements == p.placements
                assert shard.to_local().device.type == "cpu", (empty, key)
                assert shard.to_local().data_ptr() == optimizer.inner.state[master][key].data_ptr(), (empty, key)
    loaded = fresh.checkpoint_state(fresh_names, empty=True)
    for entry in loaded["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            assert entry[key].to_local().device.type == "cpu"
            entry[key].to_local().fill_(0.5)
    fresh.load_checkpoint_state(loaded, fresh_names)
    for p, master in zip(fresh.params, fresh.masters):
        for key in ("exp_avg", "exp_avg_sq"):
            assert fresh.inner.state[master][key].data_ptr() == loaded["state"][fresh_names[id(p)]][key].to_local().data_ptr()
            assert torch.equal(fresh.inner.state[master][key], torch.full(master.shape, 0.5))


def test_a_host_optimizer_checkpoint_round_trips_through_the_checkpoint_format(one_rank_mesh, tmp_path):
    import torch.distributed.checkpoint as dcp

    optimizer, names = _stepped_host_optimizer(one_rank_mesh)
    dcp.save({"optim": optimizer.checkpoint_state(names)}, checkpoint_id=str(tmp_path / "ckpt"))
    fresh, fresh_names = _stepped_host_optimizer(one_rank_mesh)
    fresh.inner.state.clear()
    loaded = {"optim": fresh.checkpoint_state(fresh_names, empty=True)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ckpt"))
    fresh.load_checkpoint_state(loaded["optim"], fresh_names)
    for a, b in zip(optimizer.masters, fresh.masters):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.inner.state[a][key], fresh.inner.state[b][key]), key
