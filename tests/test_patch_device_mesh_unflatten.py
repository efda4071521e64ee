"""device-mesh-unflatten: ``DeviceMesh._unflatten(dim, mesh_sizes, mesh_dim_names)``.

On 4 ranks (gloo), a 1-D world mesh named ``world`` is unflattened into ``(dp_shard=2, tp=2)`` as
torchtitan 0.3 builds its meshes, and a 2-D ``(pp=2, rest=2)`` mesh's ``rest`` into ``(dp=1, tp=2)``; each
rank reports the result's dim names, shape, rank grid, its coordinate, each dim's group ranks and an
all-reduce of its rank over each dim, and the errors of a wrong product, an unknown dim name and
mismatched names. Then the world mesh is unflattened twice as torchtitan builds its meshes,
``(batch=2, tp=2)`` and ``(fsdp=2, tp=2)``: each rank reports whether ``data["tp"]``, ``dense["fsdp"]`` and
the flattened ``data["batch", "tp"]`` share the world mesh as root, those meshes' groups, and whether
FSDP over ``dense["fsdp"]`` of a model tensor-parallel over ``data["tp"]`` (FSDP's same-parent check)
gives the gradients of the same model on one process. With TORCHPATCH=1 on torch 2.9 everything must
equal what the same ranks report on torch 2.15 natively (run in its venv by the same test); natively 2.9
has no ``_unflatten``. On 2.4 each unflattened mesh is a root of its own: the roots differ from 2.15's (the
rest as on 2.15; FSDP over one unflattening with TP over another through fsdp2-unflattened-meshes).
One gloo process (world size 1) also unflattens its world mesh into torchtitan 0.2.2's four dimensions
``(pp, batch, cp, tp)`` and reports the mesh, a two-name slice and an all-reduce over a dimension's group
and the same three errors, equal to torch 2.15's native report.
"""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, free_port, newest_torch_ranks_result, patch_applies_here,
    ranks_result, run_json, run_newest_torch_json, through_patch_range, torch_matches, where_patch_applies
)

RANKS = """
import datetime, json, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()

def describe(mesh):
    out = {"names": list(mesh.mesh_dim_names), "shape": list(mesh.shape), "grid": mesh.mesh.tolist(),
           "coordinate": mesh.get_coordinate(), "groups": {}, "sums": {}}
    for name in mesh.mesh_dim_names:
        out["groups"][name] = dist.get_process_group_ranks(mesh.get_group(name))
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mesh.get_group(name))
        out["sums"][name] = t.item()
    return out

def error(call):
    try:
        call()
        return "no error"
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"

def root(mesh):
    if hasattr(mesh, "_get_root_mesh"):
        return mesh._get_root_mesh()
    from torch.distributed.device_mesh import _mesh_resources
    if not hasattr(_mesh_resources, "get_root_mesh"):  # torch 2.4
        return _mesh_resources.get_parent_mesh(mesh) or mesh
    return _mesh_resources.get_root_mesh(mesh)

def fsdp_tp(dp_mesh, tp_mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).double()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).double()
    model.load_state_dict(reference.state_dict())
    inputs = torch.randn(4, 8, dtype=torch.float64)
    reference(inputs).pow(2).sum().backward()
    parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    try:
        fully_shard(model, mesh=dp_mesh)
        model(inputs).pow(2).sum().backward()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return all(torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-12, atol=0)
               for p, q in zip(model.parameters(), reference.parameters()))

world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
if not hasattr(world, "_unflatten"):
    out = {"unflatten": "missing"}
else:
    two = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "rest"))
    out = {"world": describe(world._unflatten(0, (2, 2), ("dp_shard", "tp"))),
           "rest": describe(two._unflatten("rest", (1, 2), ("dp", "tp"))),
           "product": error(lambda: world._unflatten(0, (3, 2), ("a", "b"))),
           "name": error(lambda: world._unflatten("nope", (2, 2), ("a", "b"))),
           "names": error(lambda: world._unflatten(0, (2, 2), ("a",)))}
    data = world._unflatten(0, (2, 2), ("batch", "tp"))
    dense = world._unflatten(0, (2, 2), ("fsdp", "tp"))
    batch_tp = data["batch", "tp"]._flatten("batch_tp")
    meshes = {"tp": data["tp"], "fsdp": dense["fsdp"], "batch_tp": batch_tp}
    out["roots"] = {name: root(mesh) == world for name, mesh in meshes.items()}
    out["shared"] = {name: describe(mesh) for name, mesh in meshes.items()}
    out["fsdp_tp"] = fsdp_tp(dense["fsdp"], data["tp"])
import torchpatch
out["status"] = torchpatch.status().get("device-mesh-unflatten")
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


def run(tmp_path, **env) -> list:
    return ranks_result(RANKS, nproc=4, tmp_path=tmp_path, env=clean_env(**env), timeout=240)


@where_patch_applies("device-mesh-unflatten", "DeviceMesh has no _unflatten")
def test_native_has_no_unflatten(tmp_path):
    assert run(tmp_path) == [{"unflatten": "missing", "status": None}] * 4


@through_patch_range("device-mesh-unflatten", "DeviceMesh._unflatten")
def test_unflatten_as_the_newest_torch(tmp_path):
    here = run(tmp_path, TORCHPATCH="1")
    newest = newest_torch_ranks_result(RANKS, nproc=4, tmp_path=tmp_path)
    separate_roots = torch_matches("<2.5")  # 2.4: each unflattened mesh is a root of its own
    for mine, theirs in zip(here, newest):
        assert mine.pop("status") == ("applied" if patch_applies_here("device-mesh-unflatten") else None)
        theirs.pop("status")
        if separate_roots:
            roots = mine.pop("roots")
            theirs.pop("roots")
            assert roots == {"tp": False, "fsdp": False, "batch_tp": False}, roots
        assert mine == theirs
    if not separate_roots:
        assert here[0]["roots"] == {"tp": True, "fsdp": True, "batch_tp": True}
    # FSDP over one unflattening with TP over another (on 2.4 through fsdp2-unflattened-meshes)
    assert all(rank["fsdp_tp"] is True for rank in here), [rank["fsdp_tp"] for rank in here]


ONE_PROCESS = """
import json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo")
world = init_device_mesh("cpu", (1,), mesh_dim_names=("world",))
mesh = world._unflatten(0, (1, 1, 1, 1), ("pp", "batch", "cp", "tp"))
out = {"mesh": mesh.mesh.tolist(), "names": list(mesh.mesh_dim_names), "tp": mesh["tp"].size(),
       "batch_tp": list(mesh["batch", "tp"].mesh_dim_names)}
t = torch.ones(1)
dist.all_reduce(t, group=mesh["batch"].get_group())
out["sum"] = t.item()
errors = {}
for name, call in {"product": lambda: world._unflatten(0, (2, 1), ("a", "b")),
                   "name": lambda: world._unflatten("nope", (1,), ("a",)),
                   "lengths": lambda: world._unflatten(0, (1, 1), ("a",))}.items():
    try:
        call()
        errors[name] = None
    except (ValueError, RuntimeError, AssertionError) as exc:
        errors[name] = [type(exc).__name__, str(exc)]
out["errors"] = errors
print(json.dumps(out), flush=True)
os._exit(0)
"""


@where_patch_applies("device-mesh-unflatten")
def test_one_process_unflattens_as_torchtitan_0_2_2():
    here = run_json(ONE_PROCESS, args=[str(free_port())], env=clean_env(TORCHPATCH="1"))
    assert here == run_newest_torch_json(ONE_PROCESS, str(free_port()))
