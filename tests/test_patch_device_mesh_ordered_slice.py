"""device-mesh-ordered-slice: ``mesh["dp", "tp"]`` of a ``("dp", "cp", "tp")`` mesh on torch 2.4.

Natively (and with the patch turned off) torch 2.4 refuses names that skip a dimension (torchtitan
0.3.0's FSDP + TP with ``cp`` 1). On 4 real ranks (gloo, a 2 x 1 x 2 mesh) the submesh holds the
ranks, sizes, local ranks and group members torch 2.15 gives natively to the same script (its result,
computed once, is the reference), each dimension's group all-reduces over exactly its ranks, the
submesh's parent is the mesh, and names out of order raise ``KeyError``. Where torch slices so itself
the patch is not armed.
"""

import pytest

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, newest_torch_ranks_result, patch_applies_here, ranks_result, run_json,
    through_patch_range, where_patch_applies
)

NATIVE = """
import json, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "cp", "tp"))
try:
    mesh["dp", "tp"]
    error = None
except KeyError as exc:
    error = str(exc)
import torchpatch
print(json.dumps({"error": error, "status": torchpatch.status().get("device-mesh-ordered-slice")}))
"""


@where_patch_applies("device-mesh-ordered-slice", "torch 2.4 slices by contiguous names only")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_DEVICE_MESH_ORDERED_SLICE": "0"}],
                         ids=["unset", "opted-out"])
def test_native_refuses_names_that_skip_a_dimension(env):
    out = run_json(NATIVE, env=clean_env(**env))
    assert out["status"] is None
    assert "Valid mesh_dim_names should be a contiguous subsequence of ('dp', 'cp', 'tp')" in out["error"], out


SCRIPT = """
import datetime, json, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "cp", "tp"))
sub = mesh["dp", "tp"]
out = {"mesh": sub.mesh.tolist(), "names": list(sub.mesh_dim_names), "size": [sub.size(0), sub.size(1)],
       "local": [sub.get_local_rank(n) for n in ("dp", "tp")],
       "groups": [dist.get_process_group_ranks(sub.get_group(n)) for n in ("dp", "tp")], "sums": []}
for name in ("dp", "tp"):
    t = torch.tensor([float(2 ** rank)])
    dist.all_reduce(t, group=sub.get_group(name))
    out["sums"].append(t.item())
from torch.distributed.device_mesh import _mesh_resources
root = getattr(_mesh_resources, "get_root_mesh", None) or _mesh_resources.get_parent_mesh
out["parent_is_mesh"] = root(sub) is mesh
try:
    mesh["tp", "dp"]
    out["out_of_order"] = None
except KeyError:
    out["out_of_order"] = "KeyError"
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@through_patch_range("device-mesh-ordered-slice", "slicing by names in the mesh's order")
def test_submesh_equals_torch_2_15s(tmp_path):
    ranks = ranks_result(SCRIPT, nproc=4, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=180)
    assert ranks == newest_torch_ranks_result(SCRIPT, nproc=4, tmp_path=tmp_path)
    assert ranks[0]["groups"] == [[0, 2], [0, 1]] and ranks[0]["sums"] == [5.0, 3.0], ranks[0]
    assert all(r["parent_is_mesh"] and r["out_of_order"] == "KeyError" for r in ranks), ranks
    status = run_json("import json, torch.distributed.device_mesh, torchpatch; "
                      "print(json.dumps(torchpatch.status().get('device-mesh-ordered-slice')))", env=clean_env(TORCHPATCH="1"))
    assert status == ("applied" if patch_applies_here("device-mesh-ordered-slice") else None)
