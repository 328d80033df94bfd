"""The launch recipes in examples/ pass flags the trainer accepts and a configuration it validates.

Each script runs with fake torchrun / srun / mpirun / python on PATH that record the command
line; the trainer's flags are then parsed and validated as the real launch would (world size
from the recipe), with placeholder data files.
"""

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from megatron_lc.arguments import parse_config

REPO = Path(__file__).resolve().parents[2]
RECORDER = """#!/usr/bin/env python3
import json, os, sys
prog = os.path.basename(sys.argv[0])
with open({out!r}, "a") as f:
    f.write(json.dumps({{"prog": prog, "argv": sys.argv[1:], "nvls": os.environ.get("NCCL_NVLS_ENABLE"),
                        "nccl": {{k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}}}) + "\\n")
if sys.argv[1:3] == ["show", "hostnames"]:
    print("node1")
if "megatron_lc.train" in sys.argv and os.environ.get("FAKE_STOPPED"):
    open(os.environ["FAKE_STOPPED"], "w").write("{{}}")
sys.exit(int(os.environ.get("FAKE_EXIT_" + prog.upper(), "0")))
"""
RECIPES = [
    ("examples/pretrain_llama_5m.sh", [], 8),
    ("examples/pretrain_llama_3m.sh", [], 8),
    ("examples/pretrain_llama_7m.sh", [], 8),
    ("examples/slurm/pretrain_llama_8m_2nodes.sbatch", [], 16),
    ("examples/slurm/pretrain_llama_8m_2nodes_torchrun.sbatch", [], 16),
    ("examples/pretrain_llama_70b.sh", [], 32),
    ("examples/mpirun_pretrain.sh", ["hosts"], 8),
]
SLURM_JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]"}


def _run_recipe(script: str, args: list[str], tmp_path: Path, env: dict | None = None,
                status: int = 0) -> tuple[int, list[dict]]:
    """The recipe's exit status and every command it ran (fake launchers that record their command lines)."""
    bin_dir, out = tmp_path / "bin", tmp_path / "argv.jsonl"
    bin_dir.mkdir(exist_ok=True)
    out.unlink(missing_ok=True)
    for name in ("torchrun", "srun", "mpirun", "python", "scontrol"):
        fake = bin_dir / name
        fake.write_text(RECORDER.format(out=str(out)))
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "SLURM_"))}, **SLURM_JOB,
           **(env or {}), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(REPO / script), *args], env=env, timeout=60, cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == status, done.stderr[-2000:]
    return done.returncode, [json.loads(line) for line in out.read_text().splitlines()]


def _recorded_launch(script: str, args: list[str], tmp_path: Path, env: dict | None = None) -> dict:
    """The launcher's command line and the NCCL settings it saw."""
    return [c for c in _run_recipe(script, args, tmp_path, env)[1] if "megatron_lc.train" in c["argv"]][-1]


def _recorded_train_args(script: str, args: list[str], tmp_path: Path) -> list[str]:
    argv = _recorded_launch(script, args, tmp_path)["argv"]
    return argv[argv.index("megatron_lc.train") + 1:]


@pytest.mark.parametrize("script, leading, world_size", RECIPES)
def test_recipe_flags_parse_and_validate(script, leading, world_size, tmp_path):
    data = tmp_path / "corpus_text_document"
    for suffix in (".bin", ".idx"):
        Path(f"{data}{suffix}").write_bytes(b"")
    args = _recorded_train_args(script, [*leading, str(data), "tokenizer.model", str(tmp_path / "ckpt")], tmp_path)
    cfg = parse_config(args)
    cfg.data.tokenizer_type = None  # the Llama 3 tokenizer file is not here; its vocabulary is the flavour's
    cfg.validate(world_size)
    assert cfg.checkpoint.save and cfg.train.exit_signal_handler


@pytest.mark.parametrize("script, leading, world_size", RECIPES)
def test_recipe_turns_nvls_off_unless_the_user_chose(script, leading, world_size, tmp_path):
    """NCCL_NVLS_ENABLE=0 reaches the launcher (and, under mpirun, is forwarded with -x to every rank)."""
    args = [*leading, "corpus", "tokenizer.model", str(tmp_path / "ckpt")]
    launch = _recorded_launch(script, args, tmp_path)
    assert launch["nvls"] == "0"
    if "mpirun" in script:
        assert launch["argv"][launch["argv"].index("NCCL_NVLS_ENABLE") - 1] == "-x"
    assert _recorded_launch(script, args, tmp_path, {"NCCL_NVLS_ENABLE": "1"})["nvls"] == "1"


@pytest.mark.parametrize("script, leading, world_size", RECIPES)
def test_long_runs_save_by_time_as_well_as_by_steps(script, leading, world_size, tmp_path):
    data = tmp_path / "corpus_text_document"
    args = _recorded_train_args(script, [*leading, str(data), "tokenizer.model", str(tmp_path / "ckpt")], tmp_path)
    cfg = parse_config(args)
    assert cfg.checkpoint.save_interval_minutes and cfg.checkpoint.save_interval_minutes <= 240


@pytest.mark.parametrize("script, leading, world_size", RECIPES)
def test_every_launcher_gets_the_same_nccl_settings(script, leading, world_size, tmp_path):
    """examples/nccl_settings.sh, sourced by every recipe: the plan's channels and buffers, NVLS off, NCCL_DEBUG,
    and the site's NCCL_SOCKET_IFNAME / NCCL_IB_HCA when given (mpirun forwards each with -x)."""
    args = [*leading, "corpus", "tokenizer.model", str(tmp_path / "ckpt")]
    site = {"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5_0,mlx5_1"}
    launch = _recorded_launch(script, args, tmp_path, site)
    assert launch["nccl"] == {"NCCL_MAX_NCHANNELS": "16", "NCCL_BUFFSIZE": "4194304", "NCCL_NVLS_ENABLE": "0",
                              "NCCL_DEBUG": "WARN", **site}
    if "mpirun" in script:
        forwarded = {launch["argv"][i + 1] for i, a in enumerate(launch["argv"]) if a == "-x"}
        assert set(launch["nccl"]) <= forwarded
    assert "NCCL_SOCKET_IFNAME" not in _recorded_launch(script, args, tmp_path)["nccl"]  # unset unless given


def test_the_nvls_setting_says_why_in_one_line():
    lines = (REPO / "examples/nccl_settings.sh").read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("export NCCL_NVLS_ENABLE="))
    assert lines[i - 1].startswith("# NVLS") and "memory plan" in lines[i - 1]


@pytest.mark.parametrize("script", ["examples/slurm/pretrain_llama_8m_2nodes.sbatch",
                                    "examples/slurm/pretrain_llama_8m_2nodes_torchrun.sbatch"])
def test_sbatch_requests_fit_a_dgx_h100_and_the_job_requeues_itself(script, tmp_path):
    text = (REPO / script).read_text()
    per_task = int(re.search(r"#SBATCH --cpus-per-task=(\d+)", text).group(1))
    tasks = int(re.search(r"#SBATCH --ntasks-per-node=(\d+)", text).group(1))
    assert per_task * tasks <= 112 and "#SBATCH --requeue" in text and "#SBATCH --mem=0" in text
    args = ["corpus", "tokenizer.model", str(tmp_path / "ckpt")]
    (tmp_path / "ckpt").mkdir()
    stopped = tmp_path / "ckpt" / "stopped_to_resume.json"

    def requeued(commands):
        return [c["argv"] for c in commands if c["prog"] == "scontrol" and c["argv"][0] == "requeue"]

    _, commands = _run_recipe(script, args, tmp_path, {"FAKE_EXIT_SRUN": "3"}, status=0)  # srun: the tasks' 3
    assert requeued(commands) == [["requeue", "4242"]]
    _, commands = _run_recipe(script, args, tmp_path, {"FAKE_EXIT_SRUN": "1", "FAKE_STOPPED": str(stopped)},
                              status=0)  # torchrun's 1, with the run's word that it stopped to be resumed
    assert requeued(commands) == [["requeue", "4242"]]
    stopped.write_text("{}")  # left by an earlier run: removed before the launch, never read for this one
    _, commands = _run_recipe(script, args, tmp_path, {"FAKE_EXIT_SRUN": "1"}, status=1)
    assert requeued(commands) == [] and not stopped.exists()
    _, commands = _run_recipe(script, args, tmp_path, {"FAKE_EXIT_SRUN": "2"}, status=2)  # a configuration error
    assert requeued(commands) == []
    _, commands = _run_recipe(script, args, tmp_path)
    assert requeued(commands) == []


def test_the_multi_node_torchrun_recipe_meets_on_the_jobs_first_node(tmp_path):
    launch = _recorded_launch("examples/slurm/pretrain_llama_8m_2nodes_torchrun.sbatch",
                              ["corpus", "tokenizer.model", str(tmp_path / "ckpt")], tmp_path)
    argv = launch["argv"]
    torchrun = argv[argv.index("torchrun"):]
    assert argv[:argv.index("torchrun")] == ["--kill-on-bad-exit=1", "--ntasks-per-node=1"]
    assert torchrun[torchrun.index("--nnodes") + 1] == "2" and torchrun[torchrun.index("--nproc-per-node") + 1] == "8"
    assert torchrun[torchrun.index("--rdzv-backend") + 1] == "c10d"
    assert torchrun[torchrun.index("--rdzv-endpoint") + 1] == "node1:29500"
    assert torchrun[torchrun.index("--rdzv-id") + 1] == "megatron-lc-4242"


def _recorded_launches(script: str, args: list[str], tmp_path: Path, env: dict | None = None) -> list[list[str]]:
    """Every command line the recipe launched, in order."""
    _recorded_launch(script, args, tmp_path, env)
    return [json.loads(line)["argv"] for line in (tmp_path / "argv.jsonl").read_text().splitlines()]


def _module_args(launches: list[list[str]], module: str) -> list[list[str]]:
    return [argv[argv.index(module) + 1:] for argv in launches if module in argv]


def _validated(args: list[str], world_size: int, data: Path):
    cfg = parse_config([a if a != "DATA" else str(data) for a in args])
    cfg.data.tokenizer_type = None  # the model's tokenizer is not here; its vocabulary is the checkpoint's
    cfg.checkpoint.use_checkpoint_args = False  # no converted checkpoint to read the shape from
    cfg.validate(world_size)
    return cfg


def test_the_extension_recipe_resets_positions_with_attention_at_every_stage(tmp_path):
    data = tmp_path / "corpus"
    for suffix in (".bin", ".idx"):
        Path(f"{data}{suffix}").write_bytes(b"")
    (tmp_path / "w").mkdir()  # the recipe's outputs (the recorded launchers write none)
    launches = _recorded_launches("examples/extend_llama3_8b.sh", ["hf", str(data), "tok", str(tmp_path / "w")],
                                  tmp_path)
    stages = _module_args(launches, "megatron_lc.train")
    assert len(stages) == 3
    for args in stages:  # each document attends to itself from position 0, as the model was pretrained
        assert "--reset-attention-mask" in args and "--reset-position-ids" in args
        _validated(args + ["--model", "llama3-8b"], 8, data)


def test_the_chat_fine_tuning_recipe_packs_1m_token_samples_and_evaluates_the_same_part(tmp_path):
    work = tmp_path / "w"
    data = work / "data" / "sft_messages_document"
    args = ["Llama-3.1-8B-Instruct", "chat.jsonl", str(work)]
    _, commands = _run_recipe("examples/sft_llama3_8b_long.sh", args, tmp_path)
    launches = [c["argv"] for c in commands]
    preprocess = next(argv for argv in launches if argv[0].endswith("preprocess_data.py"))
    assert preprocess[preprocess.index("--json-keys") + 1] == "messages" and "--chat-template" in preprocess
    assert any(argv[0].endswith("convert_from_hf.py") for argv in launches)
    for suffix in (".bin", ".idx"):
        Path(f"{data}{suffix}").write_bytes(b"")
    (train,) = _module_args(launches, "megatron_lc.train")
    cfg = _validated(train + ["--model", "llama3-8b"], 8, data)
    assert cfg.packing.packing == "documents" and cfg.data.seq_length == 1_048_576 and cfg.checkpoint.finetune
    assert cfg.parallel.context_parallel_size == 8 and cfg.train.bf16 and cfg.checkpoint.save
    assert cfg.context_layout().ring_size == 8 and cfg.parallel.cp_document_layout == "split"  # balanced ring
    assert cfg.checkpoint.save_interval_minutes
    (evaluate,) = _module_args(launches, "megatron_lc.evaluate")
    from megatron_lc.evaluate import build_parser

    evaluated = build_parser().parse_args(evaluate)
    assert (evaluated.packing, evaluated.split, evaluated.split_part, evaluated.seq_length) == \
        ("documents", cfg.data.split, "valid", cfg.data.seq_length)
    assert launches[-1][0].endswith("convert_to_hf.py")


def test_the_chat_fine_tuning_recipe_run_again_resumes_its_own_progress_and_stops_to_be_resumed(tmp_path):
    work = tmp_path / "w"
    data = work / "data" / "sft_messages_document"
    data.parent.mkdir(parents=True)
    for suffix in (".bin", ".idx"):
        Path(f"{data}{suffix}").write_bytes(b"")
    for done in ("converted", "ckpt"):
        (work / done).mkdir()
        (work / done / "latest_checkpointed_iteration.txt").write_text("40")
    args = ["Llama-3.1-8B-Instruct", "chat.jsonl", str(work)]
    _, commands = _run_recipe("examples/sft_llama3_8b_long.sh", args, tmp_path)
    launches = [c["argv"] for c in commands]
    assert not any(argv[0].endswith(("preprocess_data.py", "convert_from_hf.py")) for argv in launches)
    (train,) = _module_args(launches, "megatron_lc.train")
    assert train[train.index("--load") + 1] == str(work / "ckpt") and "--finetune" not in train
    stopped = work / "ckpt" / "stopped_to_resume.json"
    _, commands = _run_recipe("examples/sft_llama3_8b_long.sh", args, tmp_path,
                              {"FAKE_EXIT_TORCHRUN": "1", "FAKE_STOPPED": str(stopped)}, status=3)
    assert not _module_args([c["argv"] for c in commands], "megatron_lc.evaluate")  # stopped, not moved on


def test_70b_recipe_launches_4_nodes_of_8_with_a_rendezvous(tmp_path):
    argv = _recorded_launch("examples/pretrain_llama_70b.sh", ["corpus", "tokenizer.model", str(tmp_path / "c")],
                            tmp_path, {"MASTER_ADDR": "node0"})["argv"]
    launcher = argv[:argv.index("-m")]
    assert launcher[launcher.index("--nnodes") + 1] == "4" and launcher[launcher.index("--nproc-per-node") + 1] == "8"
    assert launcher[launcher.index("--rdzv-endpoint") + 1] == "node0:29500"


@pytest.mark.parametrize("script, world_size", [("examples/pretrain_llama_5m.sh", 8),
                                               ("examples/slurm/pretrain_llama_8m_2nodes.sbatch", 16)])
def test_a_recipe_plans_the_run_it_launches_and_hands_it_the_plan(script, world_size, tmp_path):
    """The planner is asked about the flags the run is launched with (a plan of other flags would be refused),
    on the run's GPUs, and the run gets the file: each step's peak is logged beside the planned one."""
    from megatron_lc.planning.cli import split_argv
    from megatron_lc.training.memory_plan import planned_run

    ckpt = tmp_path / "ckpt"
    commands = _run_recipe(script, ["corpus", "tokenizer.model", str(ckpt)], tmp_path)[1]
    planner = next(c["argv"] for c in commands if c["argv"][0].endswith("tools/estimate_memory.py"))
    launch = next(c["argv"] for c in commands if "megatron_lc.train" in c["argv"])
    train_args = launch[launch.index("megatron_lc.train") + 1:]
    machine, planned = split_argv(planner[1:])
    assert machine.num_gpus == world_size and machine.json
    assert planned_run(parse_config(planned), machine.num_gpus) == planned_run(parse_config(train_args), world_size)
    assert train_args[train_args.index("--memory-plan") + 1] == str(ckpt / "memory_plan.json")
