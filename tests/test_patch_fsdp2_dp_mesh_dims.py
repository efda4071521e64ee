"""fsdp2-dp-mesh-dims: ``fully_shard(mesh=full_mesh, dp_mesh_dims=...)`` where only the data-parallel
dims have several ranks.

On 2 real ranks (gloo), float64, fsdp2-spmd-types' rank script: a small MLP (one weight with 5 rows:
uneven over 2 ranks) on the mesh ``(dp_shard=2,)`` (torchtitan 0.3's storage mesh for FSDP: its dims of
several ranks), its parameters annotated as torchtitan 0.3 annotates them (``spmd.assert_type(param,
{"dp_shard": spmd.R})``), sharded per block and on the root with
``dp_mesh_dims=DataParallelMeshDims(shard="dp_shard")``, trains 4 SGD steps, each rank on its half of
the batch; losses and full parameters are compared with the same model trained on one process on the
full batch in the same run. Unannotated plain parameters and a parameter annotated ``S(0)`` on the FSDP
axis raise torch 2.15's ``ValueError``s. Torch 2.14+ does this natively where spmd_types is installed
(the newest torch validates the expectation; 2.12-2.13 with fsdp2-spmd-types); 2.9-2.11 natively have
no ``dp_mesh_dims`` (``TypeError``). Where the patch applies, a tensor-parallel dim of 2 ranks raises
its ``NotImplementedError`` (FSDP2 over a full SPMD mesh is not served there).
"""

import importlib.util

import pytest

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, gathered_tail, patch_applies_here, ranks_result,
    through_patch_range, where_patch_applies
)
from test_patch_fsdp2_spmd_types import RANKS_BODY as SPMD_TYPES_RANKS

needs_spmd_types = pytest.mark.skipif(
    importlib.util.find_spec("spmd_types") is None,
    reason="the spmd_types package is not installed here (torchtitan 0.3.0's dependency)")

# fsdp2-spmd-types' rank script (the same model, annotations, reference and errors), plus unannotated
# parameters, reporting this patch's status
RANKS = SPMD_TYPES_RANKS.replace('''m = copy.deepcopy(model)
annotate(m, spmd.S(0))''', '''m = copy.deepcopy(model)
try:
    shard(m)  # not annotated
    out["not_annotated"] = "no error"
except ValueError as exc:
    out["not_annotated"] = outcome(exc)
m = copy.deepcopy(model)
annotate(m, spmd.S(0))''') + gathered_tail("fsdp2-dp-mesh-dims")
assert "not_annotated" in RANKS and "fsdp2-dp-mesh-dims" in RANKS


ONE_CALL = """
import datetime, json, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=("dp_shard", "tp"))
try:
    fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))
    out = "sharded"
except Exception as exc:
    out = f"{type(exc).__name__}: {exc}"
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, out)
if dist.get_rank() == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


def one_call(tmp_path, mesh_shape: str, **env) -> list:
    script = ONE_CALL.replace("MESH_SHAPE", mesh_shape)
    return ranks_result(script, tmp_path=tmp_path, env=clean_env(**env), timeout=180)


def run(tmp_path, **env) -> list:
    return ranks_result(RANKS, tmp_path=tmp_path, env=clean_env(**env), timeout=180)


@where_patch_applies("fsdp2-dp-mesh-dims", "fully_shard has no dp_mesh_dims")
def test_native_fully_shard_has_no_dp_mesh_dims(tmp_path):
    # the class is fsdp-data-parallel-mesh-dims'; this patch switched off
    for out in one_call(tmp_path, "(2, 1)", TORCHPATCH="1", TORCHPATCH_FSDP2_DP_MESH_DIMS="0"):
        assert out.startswith("TypeError: ") and "dp_mesh_dims" in out, out


@needs_spmd_types
@through_patch_range("fsdp2-dp-mesh-dims", "FSDP2 with dp_mesh_dims")
def test_annotated_parameters_train_to_the_reference(tmp_path):
    for out in run(tmp_path, TORCHPATCH="1"):
        assert out.pop("status") == ("applied" if patch_applies_here("fsdp2-dp-mesh-dims") else None)
        assert out.pop("storage") == ["DTensor(Shard(dim=0),)"], out
        assert out.pop("not_annotated") == "plain-tensor error", out
        assert out.pop("sharded_on_dp") == "dp-axis error", out
        assert "train" not in out and out.pop("loss_diff") < 1e-12 and out.pop("param_diff") < 1e-12, out
        assert out == {}, out


@where_patch_applies("fsdp2-dp-mesh-dims", "FSDP2 over a full SPMD mesh is not served")
def test_tensor_parallel_dim_raises(tmp_path):
    for out in one_call(tmp_path, "(1, 2)", TORCHPATCH="1"):
        assert out.startswith("NotImplementedError: fully_shard(dp_mesh_dims=...) with mesh dims ['tp']"), out
