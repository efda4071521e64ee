"""device-mesh-toplevel: ``torch.distributed.DeviceMesh``/``init_device_mesh`` served on torch 2.1 as
the objects of ``torch.distributed._tensor.device_mesh``; nothing on 1.13 (no DeviceMesh there);
torch's own from 2.2 on. The 2-rank script is the same on 2.1 (served) and on 2.4/2.13 (native)."""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, rank_result, run_json, run_py, run_ranks,
    where_patch_applies
)

IMPORT = "from torch.distributed import DeviceMesh"

SCRIPT = r"""
import datetime, json, torch, torch.distributed as dist
from torch.distributed import DeviceMesh, init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
try:
    from torch.distributed.device_mesh import DeviceMesh as home  # torch >= 2.2 (dtensor-public on 2.1)
except ImportError:
    from torch.distributed._tensor.device_mesh import DeviceMesh as home
mesh = init_device_mesh("cpu", (world,))
group = mesh.get_group(0) if hasattr(mesh, "get_group") else mesh.get_dim_groups()[0]
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t, group=group)
out = {
    "same_class": DeviceMesh is home and dist.DeviceMesh is DeviceMesh,
    "is_mesh": isinstance(mesh, dist.DeviceMesh) and isinstance(DeviceMesh("cpu", list(range(world))), home),
    "coordinate": mesh.get_coordinate(),
    "group_sum": t.item() == sum(range(1, world + 1)),
    "module": init_device_mesh.__module__,
}
import torchpatch
out["status"] = torchpatch.status().get("device-mesh-toplevel")
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    out["coordinates"] = [g.pop("coordinate") for g in gathered]
    out.pop("coordinate")
    print(RESULT + json.dumps(dict(out, ranks_agree=all(g == gathered[0] for g in gathered[1:]))), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


def run(tmp_path):
    out = rank_result(run_ranks(SCRIPT, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path))
    assert out.pop("ranks_agree"), out
    assert out["same_class"] and out["is_mesh"] and out["group_sum"]
    assert out["coordinates"] == [[0], [1]]
    return out


@where_patch_applies("device-mesh-toplevel", "torch 2.1 keeps DeviceMesh in torch.distributed._tensor only")
def test_native_failure():
    proc = run_py(IMPORT)
    assert "ImportError: cannot import name 'DeviceMesh' from 'torch.distributed'" in proc.stderr, proc.stderr[-2000:]
    proc = run_py("import torch.distributed as dist; dist.init_device_mesh")
    assert "AttributeError: module 'torch.distributed' has no attribute 'init_device_mesh'" in proc.stderr


@where_patch_applies("device-mesh-toplevel")
def test_served_on_two_ranks(tmp_path):
    out = run(tmp_path)
    assert out["module"] == "torch.distributed._tensor.device_mesh" and out["status"] == "applied"


@only_torch(">=2.2", "torch's own top-level names: the reference")
def test_inactive_where_native(tmp_path):
    out = run(tmp_path)
    assert out["module"] == "torch.distributed.device_mesh" and out["status"] is None


@only_torch("<2.1", "no DeviceMesh at all on torch 1.13: nothing may be served")
def test_nothing_served_without_device_mesh():
    out = run_json(
        """
        import json, torch.distributed as dist, torchpatch

        def error(fn):
            try:
                fn()
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"

        def from_import():
            from torch.distributed import DeviceMesh

        def private():
            import torch.distributed._tensor.device_mesh

        print(json.dumps({
            "attribute": error(lambda: dist.DeviceMesh),
            "hasattr": hasattr(dist, "init_device_mesh"),
            "from_import": error(from_import),
            "private": error(private),
            "status": torchpatch.status().get("device-mesh-toplevel"),
        }))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out["attribute"] == "AttributeError: module 'torch.distributed' has no attribute 'DeviceMesh'"
    assert out["hasattr"] is False
    assert out["from_import"].startswith("ImportError: cannot import name 'DeviceMesh' from 'torch.distributed'")
    assert out["private"].startswith("ModuleNotFoundError: No module named 'torch.distributed._tensor'")
    assert out["status"] is None
