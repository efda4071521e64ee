"""dcp-async-save-cpu-copy: ``dcp.async_save`` of CPU tensors that change before the save writes.

On 2 real ranks (gloo), each rank async-saves a state dict of CPU tensors (a plain tensor, a
parameter, a nested optimizer-like entry and a ``Shard(0)`` DTensor), then updates every tensor in
place, as the next optimizer step does; only then does the background save get to write (its writer
waits for the update, so the order is fixed, not a race). Loading the checkpoint back must give the
values at the ``async_save`` call (the snapshot taken in the same run). Torch 2.4 natively (and with
the patch switched off) writes the updated values; with TORCHPATCH=1 the snapshot's, through both
the default writer (``FileSystemWriter``, an ``AsyncStager``) and a writer that is not an
``AsyncStager``. On torch >= 2.7 staging copies: the snapshot's values, the patch not applied.
"""

import pytest

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, patch_applies_here, ranks_result, through_patch_range,
    where_patch_applies
)

RANKS = """
import datetime, json, os, threading, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _FileSystemWriter
try:
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor, Shard, init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, W = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (W,))
HERE = os.path.dirname(os.path.abspath(__file__))
updated = threading.Event()

def waiting(cls):
    class Writer(cls):  # the background save writes only after the main thread's update
        def write_data(self, plan, planner):
            assert updated.wait(60)
            return super().write_data(plan, planner)
    return Writer

def state():
    g = torch.Generator().manual_seed(10)  # plain tensors are replicated: the same on every rank
    return {"w": torch.randn(4, 3, generator=g, dtype=torch.float64),
            "p": torch.nn.Parameter(torch.randn(5, generator=g)),
            "optim": {"state": {"0": {"exp_avg": torch.randn(2, 2, generator=g), "step": torch.tensor(3.0)}}},
            "d": DTensor.from_local(torch.randn(2, 3, generator=g) + 10 * rank, mesh, [Shard(0)], run_check=False)}

def flat(sd):
    return {"w": sd["w"], "p": sd["p"].detach(), "exp_avg": sd["optim"]["state"]["0"]["exp_avg"],
            "step": sd["optim"]["state"]["0"]["step"], "d": sd["d"].to_local()}

out = {}
for name, cls in (("FileSystemWriter", FileSystemWriter), ("_FileSystemWriter", _FileSystemWriter)):
    path = os.path.join(HERE, name)
    updated.clear()
    sd = state()
    snapshot = {k: v.clone() for k, v in flat(sd).items()}
    future = dcp.async_save(sd, storage_writer=waiting(cls)(path))
    with torch.no_grad():  # the next training step, before the save has written
        for t in flat(sd).values():
            t.add_(100)
    updated.set()
    future.result()
    loaded = state()
    with torch.no_grad():
        for t in flat(loaded).values():
            t.zero_()
    dcp.load(loaded, checkpoint_id=path)
    out[name] = {k: ("snapshot" if torch.equal(v, snapshot[k]) else "updated" if torch.equal(v, snapshot[k] + 100) else "other")
                 for k, v in flat(loaded).items()}
import torchpatch
out["status"] = torchpatch.status().get("dcp-async-save-cpu-copy")
gathered = [None] * W
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

KEYS = ("w", "p", "exp_avg", "step", "d")


def run(tmp_path, **env) -> list:
    return ranks_result(RANKS, tmp_path=tmp_path, env=clean_env(**env), timeout=180)


@where_patch_applies("dcp-async-save-cpu-copy", "async_save stages CPU tensors without copying them")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_DCP_ASYNC_SAVE_CPU_COPY": "0"}], ids=["unset", "opted-out"])
def test_native_writes_the_updated_values(tmp_path, env):
    for out in run(tmp_path, **env):
        assert out.pop("status") is None
        assert out == {w: {k: "updated" for k in KEYS} for w in ("FileSystemWriter", "_FileSystemWriter")}, out


@through_patch_range("dcp-async-save-cpu-copy", "dcp.async_save exists from torch 2.3")
def test_checkpoint_holds_the_values_at_the_call(tmp_path):
    for out in run(tmp_path, TORCHPATCH="1"):
        assert out.pop("status") == ("applied" if patch_applies_here("dcp-async-save-cpu-copy") else None)
        assert out == {w: {k: "snapshot" for k in KEYS} for w in ("FileSystemWriter", "_FileSystemWriter")}, out
