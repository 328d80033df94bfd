"""The line rank 0 prints at start on CUDA (training; evaluation prints JSON only): NCCL's version, NCCL_NVLS_ENABLE, the
warm-up's device memory."""

import torch

from megatron_lc.training import startup


def test_the_line_names_version_nvls_and_warm_up_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert startup.nccl_settings_line(3 << 29) == \
        "NCCL 2.27.3 | NCCL_NVLS_ENABLE=0 | warm-up collectives took 1.50 GiB of device memory"
    monkeypatch.delenv("NCCL_NVLS_ENABLE")
    assert "NCCL_NVLS_ENABLE unset (NCCL's default: on where NVSwitch has it)" in startup.nccl_settings_line(0)


def test_old_torch_reports_the_version_as_an_int(monkeypatch):
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: 2708)
    assert startup.nccl_version() == "2708"


def test_only_rank_0_on_cuda_prints_it_with_the_memory_the_warm_up_took(monkeypatch, capsys):
    from megatron_lc.devices import Devices

    free = [10 << 30, 9 << 30]  # the driver's free bytes before and after the warm-up
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free.pop(0), 80 << 30))
    monkeypatch.setattr(startup, "warm_up_collectives", lambda pstate, device: None)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    cuda = Devices(torch.device("cuda", 0), torch.device("cpu"))
    startup.warmed_up_collectives(None, cuda, rank=0)
    out = capsys.readouterr().out
    assert out.startswith("NCCL 2.21.5 |") and "took 1.00 GiB" in out
    free[:] = [10 << 30]
    startup.warmed_up_collectives(None, cuda, rank=1)
    assert capsys.readouterr().out == ""


def test_on_cpu_nothing_is_measured_or_printed(monkeypatch, capsys):
    from megatron_lc.devices import Devices

    monkeypatch.setattr(torch.cuda, "mem_get_info", None)  # any call would fail
    warmed = []
    monkeypatch.setattr(startup, "warm_up_collectives", lambda pstate, device: warmed.append(device))
    startup.warmed_up_collectives(None, Devices(torch.device("cpu"), torch.device("cpu")), rank=0)
    assert warmed == [torch.device("cpu")] and capsys.readouterr().out == ""
