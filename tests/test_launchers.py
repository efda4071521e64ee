"""Beyond torchrun: Ray Train, ``accelerate launch`` and the DeepSpeed launcher, for real, on CPU.

Each test runs the EMA-by-deepcopy job (a model that keeps a ProcessGroup, deep-copied) on 2 workers
started by the launcher users run: natively every worker fails with ``TypeError: cannot pickle
'...ProcessGroup' object``; with ``TORCHPATCH=1`` handed to the workers the launcher's way, every
worker runs it, and says so in its ``TORCHPATCH_REPORT`` file (under Ray, whose workers end
without Python's exit handlers, the one written when its patches settled) and in
``torchpatch.status()`` read by the job.

The launchers are heavy: each test skips where its package is missing (the quick suite), and the
``launchers`` nox session, which installs them, sets ``LAUNCHERS_REQUIRED=1`` to fail instead.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from conftest import clean_env, free_port

pytestmark = pytest.mark.fresh_interpreter  # real launchers

ERROR = "cannot pickle 'torch._C._distributed_c10d.ProcessGroup' object"
BIN = Path(sys.executable).parent

# The job, on a default group the launcher's library has set up: each worker writes what it saw
# into OUT/worker-<rank>.json, the error included, then lets the error end it as a user's job would.
JOB = '''
import copy, json, os, sys
import torch, torch.distributed as dist, torch.nn as nn
import torchpatch


def ema_job(out):
    rank = dist.get_rank()
    model = nn.Linear(8, 8)
    model.sp_group = dist.new_group(list(range(dist.get_world_size())))  # as Open-Sora keeps its group
    seen = {"rank": rank, "pid": os.getpid()}
    try:
        ema = copy.deepcopy(model)
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t, group=ema.sp_group)
        seen.update(sum=t.tolist(), shares_group=ema.sp_group is model.sp_group,
                    separate=ema.weight.data_ptr() != model.weight.data_ptr(),
                    installed=torchpatch.is_installed(), status=torchpatch.status().get("processgroup-deepcopy"))
    except TypeError as exc:
        seen["error"] = str(exc)
        raise
    finally:
        with open(os.path.join(out, "worker-%d.json" % rank), "w") as f:
            json.dump(seen, f)
'''

ACCELERATE_MAIN = """
from accelerate import Accelerator
accelerator = Accelerator(cpu=True)  # initialises the default group
assert (accelerator.distributed_type, dist.get_backend()) == ("MULTI_CPU", "gloo"), accelerator.distributed_type
ema_job(sys.argv[1])
"""

DEEPSPEED_MAIN = """
import deepspeed
deepspeed.init_distributed()  # gloo on the CPU accelerator without oneCCL
ema_job(sys.argv[-1])  # the launcher puts --local_rank=N before our arguments
"""

RAY_MAIN = """
import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

out, storage, env_vars = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
ray.init(address="local", num_cpus=2, include_dashboard=False,  # a Ray of its own, not one running here
         runtime_env={"env_vars": env_vars})
trainer = TorchTrainer(lambda config: ema_job(out), scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                       run_config=RunConfig(storage_path=storage, name="ema"))
trainer.fit()
"""


def need(module: str) -> None:
    """Skip unless ``module`` imports; fail instead under ``LAUNCHERS_REQUIRED=1`` (the nox session)."""
    if os.environ.get("LAUNCHERS_REQUIRED") == "1":
        importlib.import_module(module)
    else:
        pytest.importorskip(module)


def job_script(tmp_path: Path, main: str) -> Path:
    path = tmp_path / "job.py"
    path.write_text(JOB + main)
    (tmp_path / "out").mkdir()
    return path


def run(env: Dict[str, str], *cmds: List[Any], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the commands side by side (a launcher, or one per node): the first non-zero exit status, and
    their output joined."""
    procs = [subprocess.Popen([str(c) for c in cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for cmd in cmds]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    status = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess([str(c) for c in cmds[0]], status, "".join(out for out, _ in outs),
                                       "".join(err for _, err in outs))


def workers(tmp_path: Path) -> List[dict]:
    """What each worker of the job saw, by rank."""
    found = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("worker-*.json")]
    return sorted(found, key=lambda w: w["rank"])


def reports(directory: Path) -> List[dict]:
    """The TORCHPATCH_REPORT files in ``directory``: the workers' (by rank), then the launchers' (no rank)."""
    found = [json.loads(p.read_text()) for p in directory.glob("torchpatch-*.json")]
    return sorted(found, key=lambda r: (r["rank"] is None, r["rank"] if r["rank"] is not None else r["pid"]))


def assert_failed_natively(proc: subprocess.CompletedProcess, tmp_path: Path) -> None:
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert ERROR in proc.stderr, proc.stderr[-3000:]
    assert [(w["rank"], w.get("error")) for w in workers(tmp_path)] == [(0, ERROR), (1, ERROR)]


def assert_every_worker_patched(proc: subprocess.CompletedProcess, tmp_path: Path) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [{k: v for k, v in w.items() if k != "pid"} for w in workers(tmp_path)] == [
        {"rank": r, "sum": [3.0, 3.0], "shares_group": True, "separate": True, "installed": True, "status": "applied"}
        for r in range(2)
    ]


def assert_reported(proc: subprocess.CompletedProcess, report_dir: Path, launchers: int) -> None:
    """One report per worker and per launcher process that imported torch, each with the patch
    applied; one summary line for the job."""
    found = reports(report_dir)
    assert [r["rank"] for r in found] == [0, 1] + [None] * launchers, [(r["rank"], r["argv"]) for r in found]
    assert [r["patches"]["processgroup-deepcopy"] for r in found] == [{"status": "applied"}] * (2 + launchers)
    assert [r["world_size"] for r in found[:2]] == [2, 2]
    summaries = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("torchpatch: ")]
    assert len(summaries) == 1 and "processgroup-deepcopy" in summaries[0], summaries


def accelerate_cmd(script: Path, tmp_path: Path) -> List[Any]:
    # --multi_gpu on a machine without GPUs: 2 torchrun workers that accelerate runs as MULTI_CPU on
    # gloo. (--cpu --num_processes 2 starts one process: accelerate's multi-CPU launch is mpirun's.)
    return [BIN / "accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
            script, tmp_path / "out"]


def accelerate_env(tmp_path: Path, **extra: Optional[str]) -> Dict[str, str]:
    return clean_env(HF_HOME=str(tmp_path / "hf"), **extra)  # no user accelerate config in the way


def test_accelerate_launch_native_failure(tmp_path):
    need("accelerate")
    script = job_script(tmp_path, ACCELERATE_MAIN)
    assert_failed_natively(run(accelerate_env(tmp_path), accelerate_cmd(script, tmp_path)), tmp_path)


def test_accelerate_launch_every_worker_patched(tmp_path):
    need("accelerate")
    script = job_script(tmp_path, ACCELERATE_MAIN)
    env = accelerate_env(tmp_path, TORCHPATCH="1", TORCHPATCH_REPORT=str(tmp_path / "reports"))
    proc = run(env, accelerate_cmd(script, tmp_path))
    assert_every_worker_patched(proc, tmp_path)
    assert_reported(proc, tmp_path / "reports", launchers=1)  # the accelerate CLI runs torchrun in-process


def deepspeed_cmd(script: Path, tmp_path: Path) -> List[Any]:
    # The CPU accelerator counts one device per NUMA node; --num_gpus 2 asks for 2 processes anyway.
    return [BIN / "deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), script, tmp_path / "out"]


def deepspeed_env(**extra: Optional[str]) -> Dict[str, str]:
    return clean_env(DS_ACCELERATOR="cpu", **extra)


def test_deepspeed_launcher_native_failure(tmp_path):
    need("deepspeed")
    script = job_script(tmp_path, DEEPSPEED_MAIN)
    assert_failed_natively(run(deepspeed_env(), deepspeed_cmd(script, tmp_path)), tmp_path)


def test_deepspeed_launcher_every_worker_patched(tmp_path):
    need("deepspeed")
    script = job_script(tmp_path, DEEPSPEED_MAIN)
    env = deepspeed_env(TORCHPATCH="1", TORCHPATCH_REPORT=str(tmp_path / "reports"))
    proc = run(env, deepspeed_cmd(script, tmp_path))
    assert_every_worker_patched(proc, tmp_path)
    assert_reported(proc, tmp_path / "reports", launchers=2)  # the deepspeed runner and deepspeed.launcher.launch


def test_deepspeed_two_nodes_without_ssh(tmp_path):
    """Multi-node as a scheduler runs it: one runner per node (``--no_ssh --node_rank N``, a hostfile
    naming both nodes), each starting its node's worker; here both nodes are this machine."""
    need("deepspeed")
    script = job_script(tmp_path, DEEPSPEED_MAIN)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    runner = [BIN / "deepspeed", "--hostfile", hostfile, "--no_ssh", "--master_addr", "127.0.0.1",
              "--master_port", free_port()]
    proc = run(deepspeed_env(TORCHPATCH="1", TORCHPATCH_REPORT=str(tmp_path / "reports")),
               *[runner + ["--node_rank", node, script, tmp_path / "out"] for node in range(2)])
    assert_every_worker_patched(proc, tmp_path)
    assert_reported(proc, tmp_path / "reports", launchers=4)  # each node's runner and launch


RAY_ALONE = pytest.mark.xdist_group("ray")  # one local Ray cluster at a time (the launchers session runs test by test)


def ray_cmd(script: Path, tmp_path: Path, env_vars: Dict[str, str]) -> List[Any]:
    return [sys.executable, script, tmp_path / "out", tmp_path / "ray_results", json.dumps(env_vars)]


def ray_env() -> Dict[str, str]:
    """The driver's environment: no TORCHPATCH, so that only runtime_env can reach the workers."""
    return clean_env(RAY_USAGE_STATS_ENABLED="0", RAY_ADDRESS=None)


@RAY_ALONE
def test_ray_train_native_failure(tmp_path):
    need("ray.train.torch")
    script = job_script(tmp_path, RAY_MAIN)
    assert_failed_natively(run(ray_env(), ray_cmd(script, tmp_path, {})), tmp_path)


@RAY_ALONE
def test_ray_train_every_worker_patched_through_runtime_env(tmp_path):
    need("ray.train.torch")
    script = job_script(tmp_path, RAY_MAIN)
    env_vars = {"TORCHPATCH": "1", "TORCHPATCH_REPORT": str(tmp_path / "reports")}
    proc = run(ray_env(), ray_cmd(script, tmp_path, env_vars))
    assert_every_worker_patched(proc, tmp_path)
    # Ray Train ends its workers with ray.kill, which skips Python's exit handlers: no summary line,
    # and the worker's report is the one it wrote when its patches settled ("complete": false). Ray
    # sets RANK only when it sets up the process group, after that: the report's rank is none. A worker
    # can still reach its own exit first (one of two, once in a CI run): then its report is the one
    # written at exit, with the rank it had by then.
    by_pid = {r["pid"]: r for r in reports(tmp_path / "reports")}
    for worker in workers(tmp_path):
        report = by_pid[worker["pid"]]
        assert report["patches"]["processgroup-deepcopy"] == {"status": "applied"}
        assert (report["complete"], report["rank"]) in ((False, None), (True, worker["rank"])), report
