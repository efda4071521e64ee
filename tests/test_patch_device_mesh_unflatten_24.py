"""device-mesh-unflatten-24: ``DeviceMesh._unflatten`` on torch 2.4 (2.10 added it). One gloo process
(world size 1) unflattens its 1-D world mesh as torchtitan 0.2.2 does (``(pp, batch, cp, tp)``; without
``backend_override``, whose ``"fake"`` groups 2.15 failed to make in this script) and reports the new mesh's ranks, names, a slice's size and a
one-element all-reduce over each dimension's group, and the errors of a wrong product, name and
length; the same script runs natively on torch 2.15 in its venv and the reports must be equal. The
multi-rank use is torchtitan 0.2.2's `tp` and `pp` cells (docs/torchtitan.md). Natively on 2.4:
``AttributeError``."""

from conftest import clean_env, free_port, run_json, run_newest_torch_json, where_patch_applies

SCRIPT = """
import json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo")
world = init_device_mesh("cpu", (1,), mesh_dim_names=("world",))
try:
    mesh = world._unflatten(0, (1, 1, 1, 1), ("pp", "batch", "cp", "tp"))
except AttributeError as exc:
    print(json.dumps({"error": str(exc)}))
    os._exit(0)
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


@where_patch_applies("device-mesh-unflatten-24", "torch 2.10 added _unflatten")
def test_native_attribute_error():
    out = run_json(SCRIPT, args=[str(free_port())], env=clean_env())
    assert "has no attribute '_unflatten'" in out["error"]


@where_patch_applies("device-mesh-unflatten-24")
def test_unflatten_as_the_newest_torch():
    here = run_json(SCRIPT, args=[str(free_port())], env=clean_env(TORCHPATCH="1"))
    newest = run_newest_torch_json(SCRIPT, str(free_port()))
    assert here == newest
