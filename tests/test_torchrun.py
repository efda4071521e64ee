"""Every process that torchrun starts is patched: one node with 2 workers, and two torchrun agents
meeting through c10d rendezvous on loopback (how clusters launch multi-node jobs). On torch 1.13 this
also needs torchrun itself patched (torchrun-py311): the agents are Python processes too."""

import json
import subprocess
import sys

import pytest

from conftest import RESULT, clean_env, free_port

pytestmark = [pytest.mark.fresh_interpreter, pytest.mark.plumbing]  # real torchrun jobs (conftest.PLUMBING_MINORS)

WORKER = """
import copy, json, os, torch, torch.distributed as dist, torchpatch
dist.init_process_group("gloo")
holder = {"group": dist.new_group(list(range(dist.get_world_size())))}
clone = copy.deepcopy(holder)
t = torch.ones(2)
dist.all_reduce(t, group=clone["group"])
print(RESULT + json.dumps({"rank": dist.get_rank(), "installed": torchpatch.is_installed(),
                           "sum": t.tolist(), "status": torchpatch.status()["processgroup-deepcopy"]}), flush=True)
dist.destroy_process_group()
""".replace("RESULT", repr(RESULT))


def results(outputs):
    """Every rank's result document; ranks' lines may interleave in torchrun's combined stdout."""
    decoder = json.JSONDecoder()
    found = [decoder.raw_decode(chunk)[0] for out in outputs for chunk in out.split(RESULT)[1:]]
    return sorted(found, key=lambda r: r["rank"])


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args]


def test_single_node_workers_are_patched(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.run(
        torchrun("--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script)),
        env=clean_env(TORCHPATCH="1"), capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert results([proc.stdout]) == [
        {"rank": r, "installed": True, "sum": [2.0, 2.0], "status": "applied"} for r in range(2)
    ]


def test_two_nodes_with_c10d_rendezvous(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    args = torchrun("--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                    f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=torchpatch-test", str(script))
    agents = [subprocess.Popen(args, env=clean_env(TORCHPATCH="1"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outs = [a.communicate(timeout=240) for a in agents]
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], [err[-2000:] for _out, err in outs]
    assert results([out for out, _err in outs]) == [
        {"rank": r, "installed": True, "sum": [2.0, 2.0], "status": "applied"} for r in range(2)
    ]
