"""dcp-load-size-mismatch: ``dcp.load`` into tensors whose size differs from the checkpoint's.

On 2 real ranks (gloo), a checkpoint holds a plain tensor of 4 elements and a ``Shard(0)`` DTensor of
global size (8, 3). Loading it into templates of another size (6 and 2 elements; (10, 3) and (6, 3))
natively (TORCHPATCH unset, or the patch switched off) succeeds on torch 2.4: the templates get the
saved values where the shapes overlap and keep their own values elsewhere (checked element by
element against the saved values and the template, computed in the same run). With TORCHPATCH=1 each
such load raises torch >= 2.6's ``ValueError: Size mismatch between saved ... and current ...``, on
every rank, while a load into templates of the saved sizes gives the saved values exactly. Torch 2.9
and 2.15 raise natively; the patch is not applied there. The same holds on one process through
``load_state_dict(..., no_dist=True)`` on torch 2.1-2.5.
"""

import pytest

from conftest import (
    clean_env, gathered_tail, only_torch, patch_applies_here, ranks_result, run_json,
    through_patch_range, where_patch_applies
)

RANKS = """
import datetime, json, os, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
try:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor, Shard, distribute_tensor, init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, W = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (W,))
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt")
saved_w = torch.arange(4.0)
saved_d = torch.arange(24.0).reshape(8, 3)
dcp.save({"w": saved_w, "d": distribute_tensor(saved_d, mesh, [Shard(0)])}, checkpoint_id=path)

def template(w_size, d_rows):
    return {"w": torch.full((w_size,), -1.0), "d": distribute_tensor(torch.full((d_rows, 3), -1.0), mesh, [Shard(0)])}

def half_loaded(got, saved):  # the saved values where the shapes overlap, the template's -1 elsewhere
    expected = torch.full_like(got, -1.0)
    rows = min(got.shape[0], saved.shape[0])
    expected[:rows] = saved[:rows]
    return torch.equal(got, expected)

out = {}
for name, (w_size, d_rows) in {"same": (4, 8), "larger": (6, 10), "smaller": (2, 6)}.items():
    sd = template(w_size, d_rows)
    try:
        dcp.load(sd, checkpoint_id=path)
    except BaseException as exc:  # dcp wraps the ranks' errors in a CheckpointException (a BaseException)
        text = str(exc)
        out[name] = "size mismatch" if "Size mismatch between saved" in text else text[-300:]
        continue
    w, d = sd["w"], sd["d"].full_tensor()
    if torch.equal(w, saved_w) and torch.equal(d, saved_d):
        out[name] = "saved values"
    elif half_loaded(w, saved_w) and half_loaded(d, saved_d):
        out[name] = "half loaded"
    else:
        out[name] = "other"
""" + gathered_tail("dcp-load-size-mismatch")


def run(tmp_path, **env) -> list:
    return ranks_result(RANKS, tmp_path=tmp_path, env=clean_env(**env), timeout=180)


@only_torch(">=2.4,<2.6", "the default load planner does not compare sizes (DTensor from torch 2.4 on the test's path)")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_DCP_LOAD_SIZE_MISMATCH": "0"}], ids=["unset", "opted-out"])
def test_native_loads_the_overlap_silently(tmp_path, env):
    for out in run(tmp_path, **env):
        assert out == {"same": "saved values", "larger": "half loaded", "smaller": "half loaded", "status": None}, out


@through_patch_range("dcp-load-size-mismatch", "dcp.save/load of DTensor", since="2.4")
def test_size_mismatch_raises(tmp_path):
    for out in run(tmp_path, TORCHPATCH="1"):
        assert out.pop("status") == ("applied" if patch_applies_here("dcp-load-size-mismatch") else None)
        assert out == {"same": "saved values", "larger": "size mismatch", "smaller": "size mismatch"}, out


ONE_PROCESS = """
import json, sys, tempfile, torch
import torch.distributed.checkpoint as dcp
path = tempfile.mkdtemp()
saved = torch.arange(4.0)
dcp.save_state_dict({"w": saved}, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
out = {}
for n in (4, 6, 2):
    sd = {"w": torch.full((n,), -1.0)}
    try:
        dcp.load_state_dict(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    except BaseException as exc:
        out[n] = "size mismatch" if "Size mismatch between saved" in str(exc) else str(exc)[-300:]
        continue
    expected = torch.full((n,), -1.0)
    expected[:min(n, 4)] = saved[:min(n, 4)]
    out[n] = "saved values" if torch.equal(sd["w"], saved) else "half loaded" if torch.equal(sd["w"], expected) else "other"
import torchpatch
out["status"] = torchpatch.status().get("dcp-load-size-mismatch")
print(json.dumps(out))
"""


@where_patch_applies("dcp-load-size-mismatch",
                     "no size check; the no_dist load_state_dict path (torch 2.1 has no DTensor dcp.load without torchpatch)")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_DCP_LOAD_SIZE_MISMATCH": "0"}, {"TORCHPATCH": "1"}],
                         ids=["unset", "opted-out", "torchpatch"])
def test_one_process_load_state_dict(env):
    patched = env == {"TORCHPATCH": "1"}
    out = run_json(ONE_PROCESS, env=clean_env(**env))
    wrong = "size mismatch" if patched else "half loaded"
    assert out == {"4": "saved values", "6": wrong, "2": wrong, "status": "applied" if patched else None}, out
