"""dcp-metadata-strides: torch 2.3-2.14 load the DCP checkpoints that torch 2.15 saves.

Torch 2.15 itself, natively, in its matrix venv (``~/.cache/torchpatch/nox/matrix-torch-2-15-0``, found
as conftest's ``NEWEST_TORCH_PYTHON``; the tests skip without it), saves in the test run: on one process
a state dict of contiguous and non-contiguous tensors (transposed, strided, permuted; float64, float32,
bfloat16, int64, 0-dim) and non-tensor values, with ``torch.save`` of the same dict beside it (what 2.15
saved); on 2 gloo ranks two DTensors (``Shard(0)`` and ``Shard(1)``) whose local shards are
non-contiguous, with the full tensors beside them. Its ``.metadata`` records each tensor's strides.

The installed torch loads those checkpoints (TORCHPATCH=1 where the patch applies, natively on 2.15):
every value bitwise equal to what 2.15 saved, on one process and on 2 ranks into DTensors, and the
unpickled ``TensorProperties.strides`` equal to the strides 2.15 recorded. It re-saves the loaded state
and 2.15 reads that checkpoint back bitwise equal. Without TORCHPATCH the older torch fails as users
see it (``ValueError: too many values to unpack (expected 5)`` reading the metadata, ``dcp.load``
raising); with TORCHPATCH=1 on torch 2.15 (and below 2.3) nothing is patched.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Dict

import pytest

import forkserver
from conftest import (LEAVE_WITHOUT_TEARDOWN, NEWEST_TORCH_PYTHON, RESULT, clean_env, launch, newest_torch_files,
                      ranks_result, rank_result, run_json, run_newest_torch_json, through_patch_range,
                      where_patch_applies, where_patch_does_not_apply)

PATCH_ID = "dcp-metadata-strides"

# Helpers of every script: the recorded strides of a checkpoint, bitwise comparison of (nested) values.
COMMON = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

def recorded_strides(path):
    md = FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: list(v.properties.strides) for k, v in sorted(md.items())
            if hasattr(v, "properties") and v.properties.strides is not None}

def bitwise(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(bitwise(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))
    return type(a) is type(b) and a == b

def template(value):  # what a loader passes to dcp.load: same shapes and dtypes, other values
    if isinstance(value, dict):
        return {k: template(v) for k, v in value.items()}
    return torch.full(value.shape, 7, dtype=value.dtype) if isinstance(value, torch.Tensor) else value
"""

SAVE_ONE_PROCESS = COMMON + """
path = sys.argv[1]
torch.manual_seed(0)
base = torch.randn(6, 8, dtype=torch.float64)
state = {"contiguous": torch.randn(5, 3), "transposed": base.t(), "strided": base[:, ::2],
         "bf16": torch.randn(4, 4).to(torch.bfloat16).t(), "ints": torch.arange(12).view(3, 4)[:, 1:],
         "scalar": torch.tensor(3.5), "nested": {"permuted": torch.randn(2, 3, 4).permute(2, 0, 1)}}
dcp.save({**state, "step": 7}, checkpoint_id=path + "/ckpt")  # a non-tensor value too
torch.save(state, path + "/saved.pt")
print(json.dumps(recorded_strides(path + "/ckpt")))
"""

# dcp.load of torch 2.15's one-process checkpoint into fresh templates; re-saved into sys.argv[2].
LOAD_ONE_PROCESS = COMMON + """
import torchpatch
path, resave = sys.argv[1], sys.argv[2]
saved = torch.load(path + "/saved.pt")
loaded = {**template(saved), "step": 0}
dcp.load(loaded, checkpoint_id=path + "/ckpt")
step = loaded.pop("step")
dcp.save(loaded, checkpoint_id=resave)
print(json.dumps({"bitwise": bitwise(loaded, saved), "step": step, "strides": recorded_strides(path + "/ckpt"),
                  "status": torchpatch.status().get(%r)}))
""" % PATCH_ID

# torch 2.15 reads back what the older torch re-saved: bitwise equal to what 2.15 first saved.
READ_RESAVED = COMMON + """
saved = torch.load(sys.argv[1] + "/saved.pt")
loaded = template(saved)
dcp.load(loaded, checkpoint_id=sys.argv[2])
print(json.dumps(bitwise(loaded, saved)))
"""

RANK_SETUP = """
import datetime, os, torch.distributed as dist
try:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh
except ImportError:  # torch 2.4 without torchpatch
    from torch.distributed._tensor import DTensor, Shard, distribute_tensor, init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
"""

# 2 ranks of torch 2.15: each rank's shard is a transposed (non-contiguous) tensor.
SAVE_RANKS = COMMON + RANK_SETUP + """
path = sys.argv[1]
torch.manual_seed(rank)
rows = DTensor.from_local(torch.randn(3, 4).t(), mesh, [Shard(0)])      # global (8, 3)
cols = DTensor.from_local(torch.randn(5, 2, dtype=torch.float64).t(), mesh, [Shard(1)])  # global (2, 10)
full = {"rows": rows.full_tensor(), "cols": cols.full_tensor()}
dcp.save({"rows": rows, "cols": cols}, checkpoint_id=path + "/sharded")
if rank == 0:
    torch.save(full, path + "/sharded.pt")
    print(%r + json.dumps(recorded_strides(path + "/sharded")), flush=True)
""" % RESULT + LEAVE_WITHOUT_TEARDOWN

LOAD_RANKS = COMMON + RANK_SETUP + """
full = torch.load(sys.argv[1] + "/sharded.pt")
loaded = {"rows": distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)]),
          "cols": distribute_tensor(torch.zeros(2, 10, dtype=torch.float64), mesh, [Shard(1)])}
dcp.load(loaded, checkpoint_id=sys.argv[1] + "/sharded")
got = {k: v.full_tensor() for k, v in loaded.items()}
if rank == 0:
    print(%r + json.dumps({"bitwise": bitwise(got, full), "strides": recorded_strides(sys.argv[1] + "/sharded")}), flush=True)
""" % RESULT + LEAVE_WITHOUT_TEARDOWN

NATIVE_FAILURE = COMMON + """
path = sys.argv[1]
try:
    FileSystemReader(path + "/ckpt").read_metadata()
    metadata = "read"
except ValueError as exc:
    metadata = str(exc)
try:
    dcp.load(template(torch.load(path + "/saved.pt")), checkpoint_id=path + "/ckpt")
    load = "loaded"
except BaseException as exc:  # dcp may wrap it in a CheckpointException (a BaseException)
    load = type(exc).__name__
print(json.dumps({"metadata": metadata, "load": load}))
"""


@pytest.fixture(scope="module")
def saved_by_215(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, object]:
    """Torch 2.15's checkpoints (one process and 2 ranks) in a folder, with the strides it recorded: made
    once per checkout (conftest.newest_torch_files), read by every session's tests."""
    folder, strides = newest_torch_files(SAVE_ONE_PROCESS + SAVE_RANKS, _save_by_215, tmp_path_factory)
    return {"folder": str(folder), **strides}


def _save_by_215(folder: Path) -> Dict[str, object]:
    one_process = run_newest_torch_json(SAVE_ONE_PROCESS, str(folder))
    script = folder / "save_ranks.py"
    script.write_text(SAVE_RANKS)
    ranks = launch(str(script), 2, args=[str(folder)], env=clean_env(), python=str(NEWEST_TORCH_PYTHON), timeout=240,
                   popen=forkserver.popen)
    proc = subprocess.CompletedProcess([str(script)], max(abs(r.returncode) for r in ranks),
                                       "".join(r.stdout or "" for r in ranks), "".join(r.stderr or "" for r in ranks))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"one_process": one_process, "ranks": rank_result(proc)}


def _served_env() -> Dict[str, str]:
    return clean_env(TORCHPATCH="1")


def test_215_records_the_strides_of_non_contiguous_tensors(saved_by_215: Dict[str, object]) -> None:
    strides = saved_by_215["one_process"]
    assert strides["transposed"] == [1, 8] and strides["strided"] == [8, 2] and strides["nested.permuted"] == [1, 12, 4]
    assert saved_by_215["ranks"] == {"cols": [1, 2], "rows": [1, 4]}  # the local shards' strides


@through_patch_range(PATCH_ID)
def test_loads_215_checkpoint_bitwise_and_resaves_for_215(saved_by_215: Dict[str, object], tmp_path: Path) -> None:
    resaved = tmp_path / "resaved"
    got = run_json(LOAD_ONE_PROCESS, env=_served_env(), args=(saved_by_215["folder"], str(resaved)))
    assert got["bitwise"] is True and got["step"] == 7
    assert got["strides"] == saved_by_215["one_process"]  # TensorProperties.strides as 2.15 reads them
    assert run_newest_torch_json(READ_RESAVED, saved_by_215["folder"], str(resaved)) is True


@through_patch_range(PATCH_ID)
def test_loads_215_sharded_checkpoint_on_2_ranks(saved_by_215: Dict[str, object], tmp_path: Path) -> None:
    script = LOAD_RANKS.replace("sys.argv[1]", repr(saved_by_215["folder"]))
    got = ranks_result(script, tmp_path=tmp_path, env=_served_env())
    assert got == {"bitwise": True, "strides": saved_by_215["ranks"]}


@where_patch_applies(PATCH_ID)
def test_native_torch_cannot_read_215_checkpoint(saved_by_215: Dict[str, object]) -> None:
    got = run_json(NATIVE_FAILURE, env=clean_env(), args=(saved_by_215["folder"],))
    assert got["metadata"] == "too many values to unpack (expected 5)"
    assert got["load"] in ("AssertionError", "CheckpointException", "ValueError")


@where_patch_applies(PATCH_ID)
def test_own_checkpoints_keep_the_five_field_layout() -> None:
    code = """
import json, pickle, torchpatch
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as ShardedProperties
out = {}
for cls in (TensorProperties, ShardedProperties):
    props = cls()
    state = props.__getstate__()
    again = pickle.loads(pickle.dumps(props))
    out[cls.__module__] = [len(state), props.strides, again.strides, again == props]
print(json.dumps(out))
"""
    got = run_json(code, env=_served_env())
    assert len(got) == 2 and all(v == [5, None, None, True] for v in got.values())


@where_patch_does_not_apply(PATCH_ID)
def test_inactive_where_torch_has_the_field_or_predates_the_format() -> None:
    code = """
import json, torchpatch
import torch.distributed.checkpoint.metadata as metadata
print(json.dumps({"status": torchpatch.status().get(%r),
                  "own_setstate": "__wrapped__" not in dir(metadata.TensorProperties.__setstate__)}))
""" % PATCH_ID
    assert run_json(code, env=_served_env()) == {"status": None, "own_setstate": True}
