"""dtensor-public: the public DTensor API on torch 2.1–2.4, on 2 real ranks (gloo, CPU mesh).

The same rank script runs on every torch >= 2.1: served by torchpatch on 2.1 and 2.4, torch's own
API on 2.9 and 2.13, and every value is checked against a reference computed on one process.
"""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, rank_result, run_json, run_ranks,
    through_patch_range, torch_matches, where_patch_applies
)

SCRIPT = """
import contextlib, importlib, json, torch, torch.distributed as dist, torch.nn as nn
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
from torch.distributed.tensor import (
    DTensor, DeviceMesh, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor,
    empty, full, init_device_mesh, ones, rand, randn, zeros,
)
from torch.distributed.device_mesh import DeviceMesh as MeshClass, init_device_mesh as mesh_init
import torch.distributed.tensor as public, torch.distributed._tensor as private, torchpatch

NAMES = ["DTensor", "DeviceMesh", "Partial", "Placement", "Replicate", "Shard", "distribute_module",
         "distribute_tensor", "empty", "full", "init_device_mesh", "ones", "rand", "zeros"]
out = {"same_as_private": {n: getattr(public, n) is getattr(private, n) for n in NAMES},
       "device_mesh": [MeshClass is DeviceMesh, mesh_init is init_device_mesh],
       "placement_classes": [issubclass(c, Placement) for c in (Shard, Replicate, Partial)]}

def plain(t):  # torch 2.1's to_local can hand back an AsyncCollectiveTensor; clone() waits
    return t.clone()

g = torch.arange(24.0).reshape(6, 4)  # the global tensor every rank knows
mesh, mesh2 = init_device_mesh("cpu", (world,)), DeviceMesh("cpu", list(range(world)))
checks = {}
for name, m, source, placement, expect_local in [
    ("shard0", mesh, g, Shard(0), g.chunk(world, 0)[rank]),
    ("shard1_ctor_mesh", mesh2, g, Shard(1), g.chunk(world, 1)[rank]),
    ("replicate", mesh, g, Replicate(), g),
    ("uneven_shard0", mesh, g[:5], Shard(0), g[:5].chunk(world, 0)[rank]),
]:
    d = distribute_tensor(source, m, [placement])
    full_t = d.full_tensor()
    checks[name] = [isinstance(d, DTensor), tuple(d.placements) == (placement,), torch.equal(plain(d.to_local()), expect_local),
                    type(full_t) is torch.Tensor, torch.equal(full_t, source), tuple(d.shape) == tuple(source.shape)]
out["distribute_tensor"] = checks

# full_tensor is differentiable: Replicate grads come back as the local shard's slice; with
# grad_placements=[Partial()] each rank's gradient is a partial sum, reduce-scattered on the way back.
w = torch.arange(24.0).reshape(6, 4) + 1
leaf = g.chunk(world, 0)[rank].clone().requires_grad_()
(DTensor.from_local(leaf, mesh, [Shard(0)]).full_tensor() * w).sum().backward()
leaf2 = g.chunk(world, 0)[rank].clone().requires_grad_()
full_p = DTensor.from_local(leaf2, mesh, [Shard(0)]).full_tensor(grad_placements=[Partial()])
(full_p * (rank + 1)).sum().backward()
out["full_tensor_grad"] = [torch.equal(plain(leaf.grad), w.chunk(world, 0)[rank]),
                           torch.equal(plain(leaf2.grad), torch.full_like(leaf2, sum(r + 1 for r in range(world))))]

made = {
    "zeros": (zeros(6, 4, device_mesh=mesh, placements=[Shard(0)]), torch.zeros(6, 4)),
    "ones": (ones((6, 4), device_mesh=mesh, placements=[Shard(1)]), torch.ones(6, 4)),
    "full": (full((6, 4), 7.0, device_mesh=mesh, placements=[Replicate()]), torch.full((6, 4), 7.0)),
}
out["factories"] = {k: [tuple(d.shape) == (6, 4), torch.equal(d.full_tensor(), ref)] for k, (d, ref) in made.items()}
e = empty(6, 4, device_mesh=mesh, placements=[Shard(0)])
out["factories"]["empty"] = [tuple(e.shape) == (6, 4), tuple(e.to_local().shape) == (6 // world, 4)]

# DTensor's random factories draw in an RNG region that torch only has for CUDA-like meshes: on
# this CPU mesh they raise on every torch. With a tracker whose region changes nothing, a sharded
# rand/randn holds what torch.rand/torch.randn draw for the local shard from the same seed.
random_errors = {}
for fn in (rand, randn):
    try:
        fn(6, 4, device_mesh=mesh, placements=[Shard(0)])
    except (AssertionError, RuntimeError) as exc:
        random_errors[fn.__name__] = [type(exc).__name__, str(exc)]
out["random_errors"] = random_errors
rng = importlib.import_module("torch.distributed._tensor.random" if hasattr(private, "random") else "torch.distributed.tensor._random")
class SameStream:
    @contextlib.contextmanager
    def _distribute_region(self, spec):
        yield
rng._rng_tracker = SameStream()
drawn = {}
for fn, ref_fn in ((rand, torch.rand), (randn, torch.randn)):
    torch.manual_seed(rank)
    d = fn(6, 4, device_mesh=mesh, placements=[Shard(0)])
    torch.manual_seed(rank)
    drawn[fn.__name__] = [tuple(d.shape) == (6, 4), tuple(d.placements) == (Shard(0),), torch.equal(d.to_local(), ref_fn(6 // world, 4))]
out["random"] = drawn

model = distribute_module(nn.Linear(4, 2), mesh)
out["distribute_module"] = [isinstance(p, DTensor) and tuple(p.placements) == (Replicate(),) for p in model.parameters()]
out["status"] = {k: v for k, v in torchpatch.status().items() if k in ("dtensor-public", "dtensor-partial")}
out["full_tensor_module"] = DTensor.full_tensor.__module__
if rank == 0:
    print(RESULT + json.dumps(out), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@where_patch_applies("dtensor-public", "torch.distributed.tensor holds only `parallel` before 2.5")
def test_native_failure():
    out = run_json(
        """
        import json, torch.distributed._tensor as private
        errors = {}
        try:
            from torch.distributed.tensor import DTensor
        except ImportError as exc:
            errors["public"] = str(exc)
        try:
            import torch.distributed.device_mesh
        except ImportError as exc:
            errors["device_mesh"] = str(exc)
        errors["full_tensor"] = hasattr(private.DTensor, "full_tensor")
        print(json.dumps(errors))
        """
    )
    assert "cannot import name 'DTensor' from 'torch.distributed.tensor'" in out["public"]
    if torch_matches("<2.2"):
        assert out["device_mesh"] == "No module named 'torch.distributed.device_mesh'"
        assert out["full_tensor"] is False
    else:
        assert "device_mesh" not in out and out["full_tensor"] is True


@through_patch_range("dtensor-public")
def test_public_api_on_two_ranks(tmp_path):
    proc = run_ranks(SCRIPT, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = rank_result(proc)
    assert all(out["same_as_private"].values()), out["same_as_private"]
    assert out["device_mesh"] == [True, True] and out["placement_classes"] == [True] * 3
    assert out["distribute_tensor"] == {k: [True] * 6 for k in ("shard0", "shard1_ctor_mesh", "replicate", "uneven_shard0")}
    assert out["full_tensor_grad"] == [True, True]
    assert out["factories"] == {k: [True, True] for k in ("zeros", "ones", "full", "empty")}
    assert sorted(out["random_errors"]) == ["rand", "randn"]
    assert out["random"] == {"rand": [True] * 3, "randn": [True] * 3}
    assert out["distribute_module"] == [True, True]
    if torch_matches("<2.5"):
        assert out["status"] == {"dtensor-public": "applied", "dtensor-partial": "applied"}
    else:  # torch's own API: nothing served, the patches are not even armed
        assert out["status"] == {}
    # Served where torch lacks them: DTensor.full_tensor before 2.2, randn (which says why it
    # cannot draw on a CPU mesh) before 2.3.
    expect_module = "torchpatch.patches.dtensor.dtensor_public" if torch_matches("<2.2") else "torch.distributed."
    assert out["full_tensor_module"].startswith(expect_module)
    if torch_matches("<2.3"):
        assert "only has for CUDA-like device meshes, not 'cpu'" in out["random_errors"]["randn"][1]


@where_patch_applies("dtensor-public")
def test_opt_out_restores_the_native_failure():
    proc = run_json(
        """
        import json, torchpatch
        errors = {}
        for name in ("DTensor", "Partial"):
            try:
                exec(f"from torch.distributed.tensor import {name}")
            except ImportError as exc:
                errors[name] = str(exc)
        print(json.dumps({"errors": errors, "status": {k: v for k, v in torchpatch.status().items() if k in ("dtensor-public", "dtensor-partial")}}))
        """,
        env=clean_env(TORCHPATCH="1", TORCHPATCH_DTENSOR_PUBLIC="0"),
    )
    assert sorted(proc["errors"]) == ["DTensor", "Partial"]
    assert proc["status"] == {}  # dtensor-partial needs dtensor-public: both off


@only_torch("<2.1", "torch 1.13 has no DTensor: nothing may be served that cannot work")
def test_nothing_served_without_dtensor():
    out = run_json(
        """
        import json, importlib, torch, torchpatch
        missing = []
        for name in ("torch.distributed.tensor", "torch.distributed.device_mesh", "torch.distributed._tensor"):
            try:
                importlib.import_module(name)
            except ModuleNotFoundError:
                missing.append(name)
        print(json.dumps({"missing": missing, "status": sorted(torchpatch.status())}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out["missing"] == ["torch.distributed.tensor", "torch.distributed.device_mesh", "torch.distributed._tensor"]
    assert "dtensor-public" not in out["status"] and "dtensor-partial" not in out["status"]
