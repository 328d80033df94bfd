"""The CUDA allocator settings: expandable segments merged into the user's, applied before or after CUDA starts."""

import warnings

import pytest
import torch

from megatron_lc import devices
from megatron_lc.devices import set_cuda_allocator_settings, with_expandable_segments


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(devices, "_warned_expandable_off", set())
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)


def test_unset_variable_gets_expandable_segments():
    env = {}
    set_cuda_allocator_settings(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_user_keys_are_kept_and_expandable_segments_added():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512, roundup_power2_divisions:[256:1,512:2,>:4]"}
    set_cuda_allocator_settings(env)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == ("max_split_size_mb:512,roundup_power2_divisions:[256:1,512:2,>:4],"
                                              "expandable_segments:True")


def test_user_expandable_segments_true_is_left_alone():
    assert with_expandable_segments("expandable_segments:True,garbage_collection_threshold:0.6") == \
        ("expandable_segments:True,garbage_collection_threshold:0.6", False)


def test_explicit_false_is_kept_with_one_warning_naming_the_variable():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256,expandable_segments:False"}
    with pytest.warns(UserWarning) as caught:
        set_cuda_allocator_settings(env)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:256,expandable_segments:False"
    (message,) = [str(w.message) for w in caught]
    assert "PYTORCH_CUDA_ALLOC_CONF" in message and "GiB" in message and "\n" not in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_cuda_allocator_settings(env)  # once per process


def test_the_unified_variable_is_merged_too_when_set():
    env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}
    set_cuda_allocator_settings(env)
    assert env == {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"}


def test_already_initialised_cuda_gets_the_setting_at_run_time(monkeypatch):
    applied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(devices, "_apply_allocator_settings", applied.append)
    set_cuda_allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})
    assert applied == ["max_split_size_mb:128,expandable_segments:True"]
    with pytest.warns(UserWarning):
        set_cuda_allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert len(applied) == 1  # the user's False is not re-applied


def test_the_private_setter_is_the_one_torch_has(monkeypatch):
    seen = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", seen.append, raising=False)
    devices._apply_allocator_settings("expandable_segments:True")
    assert seen == ["expandable_segments:True"]
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings")
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", seen.append)
    devices._apply_allocator_settings("expandable_segments:True,max_split_size_mb:64")
    assert seen[-1] == "expandable_segments:True,max_split_size_mb:64"


def test_the_trainer_sets_it_before_resolving_devices(monkeypatch):
    from megatron_lc.training import startup, trainer

    order = []
    monkeypatch.setattr(startup, "set_cuda_allocator_settings", lambda: order.append("allocator"))

    def stop(*_):
        order.append("devices")
        raise RuntimeError("stop here")

    monkeypatch.setattr(startup, "resolve_devices", stop)
    from megatron_lc.arguments import parse_config
    with pytest.raises(RuntimeError, match="stop here"):
        trainer.build_run(parse_config(["--mock-data", "--seq-length", "64", "--device", "cpu"]))
    assert order == ["allocator", "devices"]


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.4e12),  # SXM5
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835.5e12),
    ("NVIDIA H200", 989.4e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA L4", None),
])
def test_mfu_is_measured_against_the_peak_of_the_actual_card(name, peak):
    from megatron_lc.devices import peak_dense_bf16_flops

    assert peak_dense_bf16_flops(name) == peak
