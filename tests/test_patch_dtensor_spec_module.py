"""dtensor-spec-module: ``torch.distributed.tensor._dtensor_spec`` (DTensorSpec, TensorMeta) and an
importable ``_StridedShard`` on torch 2.2-2.4 (both came with 2.5).

One process (a 1-rank gloo group, CPU mesh) imports the names the way torchtitan's SimpleFSDP does
and checks them against a real DTensor: the served classes are the very ones of
``torch.distributed._tensor.placement_types``, a real DTensor's spec and tensor metadata are
instances of them, and a spec built from them equals the DTensor's own; ``_StridedShard`` is a
``Shard`` subclass that no placement of this torch is an instance of and whose construction raises
``NotImplementedError`` naming torch >= 2.5. On torch >= 2.5 the same script runs torch's own module
and class (the reference for the spec equality) and the patch stays out of the way.
"""

from conftest import (
    clean_env, free_port, import_with_torchpatch, only_torch, run_json, run_py, until_patch_range_ends,
    where_patch_applies
)

IMPORTS = """
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard
"""


@until_patch_range_ends("dtensor-spec-module", "torch 2.5 moved DTensorSpec into torch.distributed.tensor._dtensor_spec",
                        since="2.1")
def test_native_module_not_found():
    proc = run_py(IMPORTS)
    assert "ModuleNotFoundError: No module named 'torch.distributed.tensor._dtensor_spec'" in proc.stderr, proc.stderr[-2000:]


SCRIPT = """
import json, os, sys, torch, torch.distributed as dist
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # torchtitan's SimpleFSDP
from torch.distributed.tensor.placement_types import _StridedShard
import torch.distributed.tensor._dtensor_spec as spec_module
from torch.distributed._tensor import placement_types
from torch.distributed._tensor import DeviceMesh, Replicate, Shard, distribute_tensor
import torchpatch

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
mesh = DeviceMesh("cpu", [0])
out = {"same_as_placement_types": [DTensorSpec is getattr(placement_types, "DTensorSpec", None),
                                   TensorMeta is getattr(placement_types, "TensorMeta", None)],
       "module_of": [DTensorSpec.__module__, TensorMeta.__module__, _StridedShard.__module__],
       "in_sys_modules": sys.modules.get("torch.distributed.tensor._dtensor_spec") is spec_module,
       "all": sorted(getattr(spec_module, "__all__", [])),
       "strided_same_both_paths": getattr(placement_types, "_StridedShard", None) is _StridedShard,
       "strided_is_shard": issubclass(_StridedShard, Shard)}
g = torch.arange(24.0).reshape(6, 4)
d = distribute_tensor(g, mesh, [Shard(0)])
r = d.redistribute(mesh, [Replicate()])
out["spec_isinstance"] = [isinstance(d._spec, DTensorSpec), isinstance(d._spec.tensor_meta, TensorMeta)]
mine = DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(g.shape, g.stride(), g.dtype))
out["spec_equal"] = [mine == d._spec, mine != r._spec, hash(mine) == hash(d._spec)]
out["strided_isinstance"] = [isinstance(p, _StridedShard) for p in (Shard(0), Shard(1), Replicate(), *d.placements, *r.placements)]
out["redistributed"] = torch.equal(r.to_local(), g)
try:
    _StridedShard(0, split_factor=2)
    out["strided_error"] = None
except NotImplementedError as exc:
    out["strided_error"] = str(exc)
out["status"] = torchpatch.status().get("dtensor-spec-module")
print(json.dumps(out), flush=True)
os._exit(0)  # no process-group teardown (see conftest.LEAVE_WITHOUT_TEARDOWN)
"""


def run_script():
    return run_json(SCRIPT, args=[str(free_port())], env=clean_env(TORCHPATCH="1"), timeout=120)


def check_semantics(out):
    assert out["in_sys_modules"] is True
    assert out["spec_isinstance"] == [True, True]
    assert out["spec_equal"] == [True, True, True]
    assert out["redistributed"] is True


@where_patch_applies("dtensor-spec-module")
def test_served_names_are_torch_own_classes():
    out = run_script()
    assert out["status"] == "applied"
    assert out["same_as_placement_types"] == [True, True]
    assert out["module_of"] == ["torch.distributed._tensor.placement_types"] * 3
    assert out["all"] == ["DTensorSpec", "TensorMeta"]
    assert out["strided_same_both_paths"] is True  # (2.5+ keeps _tensor.placement_types as a thin alias)
    assert out["strided_is_shard"] is True  # as torch 2.9's (newer torch derives it from a C++ StridedShard)
    check_semantics(out)
    assert out["strided_isinstance"] == [False] * 5  # no placement this torch makes is one
    assert out["strided_error"].startswith("_StridedShard needs torch >= 2.5: torch 2."), out["strided_error"]


@only_torch(">=2.5", "the reference: torch's own _dtensor_spec and _StridedShard")
def test_inactive_and_native_semantics():
    out = run_script()
    assert out["status"] is None
    assert out["module_of"] == ["torch.distributed.tensor._dtensor_spec"] * 2 + ["torch.distributed.tensor.placement_types"]
    check_semantics(out)
    assert out["strided_isinstance"] == [False] * 5
    assert out["strided_error"] is None  # torch's own placement is constructible


@only_torch("<2.2", "no DTensor before torch 2.1, no TensorMeta before 2.2 (2.1's spec uses torch.fx's "
            "TensorMetadata): nothing served")
def test_not_served_without_dtensor():
    out = import_with_torchpatch('from torch.distributed.tensor._dtensor_spec import DTensorSpec', 'dtensor-spec-module')
    assert out == {"error": "ModuleNotFoundError", "status": None}
