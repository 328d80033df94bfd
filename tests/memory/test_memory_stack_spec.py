"""The memory stack's spec builds, for every valid combination of the old memory flags, the blocks and the
offload scheduler the old code built; what the old code accepted and ignored is refused in one line."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_lc.arguments import config_from_values
from megatron_lc.devices import Devices
from megatron_lc.errors import ConfigError
from megatron_lc.memory.chunks import plan_chunks
from megatron_lc.memory.offload import OffloadScheduler
from megatron_lc.memory.stack import MemoryStack, sparse_offload_counts
from megatron_lc.models.llama import build_model

CPU = Devices(torch.device("cpu"), torch.device("cpu"))
LAYERS = 4


def _old_rules(o: dict) -> str | None:
    """Why the old code refused `o` (ParallelizeOptions.validate and config._check_memory), or None."""
    full = o["recompute_granularity"] == "full"
    if o["recompute_method"] and not full:
        return "method without full"
    if o["offload_activations"] and not full:
        return "offload without full"
    if o["offload_every_k_layers"] > 1 and not o["offload_activations"]:
        return "k without offload"
    if o["keep_attention_output"] and not full:
        return "keep without full"
    if o["offload_prefetch_early"] and not (o["offload_activations"] and not o["no_offload_prefetch"]):
        return "early without prefetch"
    if o["no_offload_prefetch"] and not o["offload_activations"]:
        return "on demand without offload"
    return None


def _old_ignored(o: dict) -> str | None:
    """A flag the old code accepted and then ignored (refused now)."""
    if o["offload_keep_last"] is not None and not o["offload_activations"]:
        return "--offload-keep-last"
    if o["tiled_mlp_tiles"] is not None and not o["tiled_mlp"]:
        return "--tiled-mlp-tiles"
    if o["tiled_loss_tiles"] is not None and not o["tiled_loss"]:
        return "--tiled-loss-tiles"
    return None


def _old_apply(o: dict, mlp_default: int, loss_default: int):
    """The old apply_memory_stack on the old options, as (per-layer modes, head tiles, scheduler arguments)."""
    full = o["recompute_granularity"] == "full"
    recompute_layers = o["recompute_num_layers"] if o["recompute_method"] == "block" else None
    checkpointed = LAYERS if recompute_layers is None else min(recompute_layers, LAYERS)
    scheduler = None
    if o["offload_activations"] and checkpointed:
        keep_last = 1 if o["offload_keep_last"] is None else o["offload_keep_last"]
        scheduler = (checkpointed, keep_last, not o["no_offload_prefetch"], o["offload_prefetch_early"],
                     o["offload_every_k_layers"])
    mlp = (o["tiled_mlp_tiles"] or mlp_default) if o["tiled_mlp"] else None
    loss = (o["tiled_loss_tiles"] or loss_default) if o["tiled_loss"] else None
    layers = []
    for i in range(LAYERS):
        recompute = o["recompute_granularity"] if not full or i < checkpointed else "none"
        layers.append((recompute, scheduler is not None and recompute == "full",
                       o["keep_attention_output"] and recompute == "full", mlp))
    return layers, loss, scheduler


def _new_apply(model, stack: MemoryStack):
    offload = stack.apply(model, CPU)
    layers = [(layer.memory.recompute, layer.memory.offload is offload and offload is not None,
               layer.memory.keep_attention, layer.mlp.num_tiles) for layer in model.layers]
    for layer in model.layers:
        assert layer.memory.offload in (None, offload)
    scheduler = None if offload is None else (offload.num_layers, offload.keep_last, offload.prefetch_enabled,
                                              offload.prefetch_early, offload.every_k)
    return layers, model.head.loss_tiles, scheduler


OLD_FLAGS = {
    "recompute_granularity": ("none", "selective", "full"),
    "recompute": ((None, None), ("block", 2), ("block", 4), ("uniform", 1)),
    "offload": ((False, False, False), (True, False, False), (True, True, False), (True, False, True),
                (False, True, False), (False, False, True), (True, True, True)),
    "offload_keep_last": (None, 0, 2),
    "offload_every_k_layers": (1, 2, 3),
    "keep_attention_output": (False, True),
    "tiles": ((False, None, False, None), (True, None, True, None), (True, 3, False, 2), (False, 3, False, None)),
}


def _combinations():
    for values in itertools.product(*OLD_FLAGS.values()):
        granularity, (method, n), (offload, on_demand, early), keep_last, k, keep, tiles = values
        yield dict(recompute_granularity=granularity, recompute_method=method, recompute_num_layers=n,
                   offload_activations=offload, no_offload_prefetch=on_demand, offload_prefetch_early=early,
                   offload_keep_last=keep_last, offload_every_k_layers=k, keep_attention_output=keep,
                   tiled_mlp=tiles[0], tiled_mlp_tiles=tiles[1], tiled_loss=tiles[2], tiled_loss_tiles=tiles[3])


def test_every_valid_old_flag_combination_builds_the_old_blocks_and_scheduler():
    model = build_model(_config(), device="meta")
    built = refused = 0
    for old in _combinations():
        cfg = None
        try:
            cfg = config_from_values({"model": "debug", "num_layers": LAYERS, "seq_length": 256, "mock_data": True,
                                      **old})
            cfg.validate(1)
        except ConfigError as error:
            assert _old_rules(old) or _old_ignored(old), (old, error)
            if _old_ignored(old) and not _old_rules(old):
                assert _old_ignored(old) in str(error), (old, error)
            refused += 1
            continue
        assert _old_rules(old) is None and _old_ignored(old) is None, old
        stack = cfg.memory_stack()
        c = cfg.model_config()
        defaults = plan_chunks(256, c.hidden_size, c.ffn_hidden_size, c.vocab_size, 4)  # the old default counts
        assert _new_apply(model, stack) == _old_apply(old, defaults.mlp_tiles, defaults.loss_tiles), old
        built += 1
    assert built > 400 and refused > 400  # the walk covers both sides


def _config():
    from megatron_lc.models.llama import get_config

    return get_config("debug", num_layers=LAYERS)


def test_counts_the_planner_reads_follow_the_scheduler():
    """Offloaded layers and host slots as the offload scheduler counts them, block method included."""
    for layers, keep_last, k in itertools.product((None, 1, 3, 4), (0, 1, 2), (1, 2, 3)):
        stack = MemoryStack(recompute_granularity="full", recompute_layers=layers, offload_mode="prefetch",
                            offload_keep_last=keep_last, offload_every_k_layers=k)
        scheduler = stack.offload_scheduler(LAYERS, CPU)
        if scheduler is None:
            assert stack.offloaded_layers(LAYERS) == 0
            continue
        assert isinstance(scheduler, OffloadScheduler)
        assert stack.offloaded_layers(LAYERS) == scheduler.offloaded_layers
        assert stack.host_slots(LAYERS) == scheduler.host_slots
        kept = sum(scheduler.should_offload(i) and scheduler.keeps_input(i) for i in range(scheduler.num_layers))
        assert stack.sparse_offload(LAYERS).kept_inputs == kept


def test_sparse_offload_counts_of_segments():
    counts = sparse_offload_counts(7, 3)  # segments of 3, 3, 1
    assert (counts.kept_inputs, counts.replayed_forwards, counts.replay_gathers) == (3, 6, 2)
    assert sparse_offload_counts(0, 2).kept_inputs == 0


@pytest.mark.parametrize("old, mode", [(["--offload-activations"], "prefetch"),
                                       (["--offload-activations", "--no-offload-prefetch"], "on_demand"),
                                       (["--offload-activations", "--offload-prefetch-early"], "early"),
                                       (["--offload-mode", "early"], "early")])
def test_old_offload_spellings_are_aliases_of_offload_mode(old, mode):
    from megatron_lc.arguments import parse_config

    cfg = parse_config(["--mock-data", "--recompute-granularity", "full", *old])
    assert cfg.memory.offload_mode == mode and cfg.memory_stack().offload_mode == mode


def test_kept_attention_layers_are_the_first_checkpointed_blocks_and_the_flag_is_refused_alone():
    from megatron_lc.arguments import parse_config

    base = ["--mock-data", "--num-layers", "4", "--recompute-granularity", "full", "--offload-mode", "prefetch"]
    cfg = parse_config([*base, "--keep-attention-output", "--keep-attention-output-layers", "2"])
    stack = cfg.memory_stack()
    assert stack.kept_attention_layers(4) == 2 and stack.offload_scheduler(4, CPU).attention_layers == 2
    assert parse_config([*base, "--keep-attention-output"]).memory_stack().kept_attention_layers(4) == 4
    for flags, message in ((["--keep-attention-output-layers", "2"], "add it"),
                           (["--keep-attention-output", "--keep-attention-output-layers", "5"], "must be in 1..4")):
        with pytest.raises(ConfigError, match=message):
            parse_config([*base, *flags]).validate(1)
