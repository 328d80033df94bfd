"""The host memory a job may pin, read from its cgroup and /proc/meminfo, weighed against what the offload arenas
will take on each node, and refused in one line with the numbers before any page is locked."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from megatron_lc.errors import ConfigError
from megatron_lc.training.logging import LIBRARY_LOGGER, show_library_log
from megatron_lc.training.preflight import HostMemory, check_host_memory, read_host_memory

GIB = 2**30


def _proc(tmp_path: Path, cgroup_line: str, available_kib: int | None = 64 * 2**20) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    meminfo = "MemTotal:       2113929216 kB\n" + (f"MemAvailable:   {available_kib} kB\n" if available_kib else "")
    (proc / "meminfo").write_text(meminfo)
    return proc


def test_a_cgroup_v2_limit_less_what_the_job_holds_beyond_page_cache_is_what_it_may_pin(tmp_path):
    root = tmp_path / "cgroup"
    job = root / "system.slice" / "slurmstepd.scope" / "job_81"
    step = job / "step_0"
    step.mkdir(parents=True)
    (root / "system.slice" / "memory.max").write_text("max\n")  # no limit above the job's
    (job / "memory.max").write_text(f"{100 * GIB}\n")
    (job / "memory.current").write_text(f"{30 * GIB}\n")
    (job / "memory.stat").write_text(f"anon {10 * GIB}\nfile {20 * GIB}\n")  # page cache is reclaimed for us
    (step / "memory.max").write_text("max\n")
    memory = read_host_memory(_proc(tmp_path, "0::/system.slice/slurmstepd.scope/job_81/step_0"), root)
    assert (memory.cgroup_limit, memory.cgroup_used, memory.mem_available) == (100 * GIB, 10 * GIB, 64 * GIB)
    assert memory.usable() == 64 * GIB  # MemAvailable is smaller here
    assert memory.cgroup_file == str(job / "memory.max")


def test_a_cgroup_v1_limit_and_a_container_that_sees_its_cgroup_as_the_root(tmp_path):
    root = tmp_path / "cgroup"
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{40 * GIB}\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{5 * GIB}\n")
    (root / "memory" / "memory.stat").write_text(f"cache {1 * GIB}\ntotal_cache {2 * GIB}\n")
    memory = read_host_memory(_proc(tmp_path, "9:memory:/slurm/uid_1/job_81"), root)
    assert memory.usable() == 37 * GIB  # 40 - (5 - 2)
    unlimited = tmp_path / "u"
    (unlimited / "memory").mkdir(parents=True)
    (unlimited / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert read_host_memory(_proc(tmp_path / "x", "9:memory:/", available_kib=None), unlimited).usable() is None


def test_a_node_whose_ranks_would_pin_more_than_the_job_may_use_is_refused_with_the_numbers():
    memory = HostMemory(cgroup_limit=100 * GIB, cgroup_used=10 * GIB, mem_available=500 * GIB,
                        cgroup_file="/sys/fs/cgroup/job_81/memory.max")
    check_host_memory(90 * GIB, "the offloaded block inputs (--offload-activations)", memory)  # fits exactly
    with pytest.raises(ConfigError) as e:
        check_host_memory(91 * GIB, "the offloaded block inputs (--offload-activations)", memory)
    assert str(e.value) == (
        f"host memory on {socket.gethostname()}: the offloaded block inputs (--offload-activations) would take "
        "91.0 GiB (1 ranks), more than this job may use there (90.0 GiB: cgroup limit 100.0 GiB "
        "(/sys/fs/cgroup/job_81/memory.max), 10.0 GiB of it in use; MemAvailable 500.0 GiB); ask the scheduler "
        "for more memory (Slurm: --mem), or offload less")
    check_host_memory(10**15, "anything", HostMemory())  # nothing known: nothing refused


def test_page_locking_lines_are_shown_on_each_nodes_first_rank(capsys):
    show_library_log(True)
    show_library_log(True)  # once per process, however often a run starts
    logging.getLogger(LIBRARY_LOGGER + ".memory.offload").info("offload: page-locking 1 GiB")
    show_library_log(False)
    logging.getLogger(LIBRARY_LOGGER + ".memory.offload").info("offload: hidden on other ranks")
    assert capsys.readouterr().out == "offload: page-locking 1 GiB\n"


def test_before_step_one_the_arenas_kept_attention_and_the_host_optimizer_are_weighed_together():
    """Offloaded block inputs, kept attention outputs and the host optimizer's exact buffers and state: one sum,
    refused in one line naming each when the node cannot hold it, before any of them is made."""
    from megatron_lc.arguments import parse_config
    from megatron_lc.models.llama import build_model
    from megatron_lc.training.optim import HostOptimizerBytes
    from megatron_lc.training.preflight import check_host_before_step_one
    from tests.helpers import TRAIN_FLAGS

    cfg = parse_config(TRAIN_FLAGS + ["--optimizer-cpu-offload"])
    model = build_model(cfg.model_config(), device="meta")
    states = HostOptimizerBytes.of(list(model.parameters())).total
    need = 3 * GIB + 2 * GIB + states
    check_host_before_step_one(cfg, model, 3 * GIB, 2 * GIB, HostMemory(mem_available=need))  # fits exactly
    with pytest.raises(ConfigError) as error:
        check_host_before_step_one(cfg, model, 3 * GIB, 2 * GIB, HostMemory(mem_available=need - 1))
    assert len(str(error.value).splitlines()) == 1
    for part in ("--offload-activations", "--keep-attention-output", "--optimizer-cpu-offload"):
        assert part in str(error.value)
