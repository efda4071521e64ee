"""mesh-layout: torch.distributed._pycute and _mesh_layout served on torch 2.4-2.9 compute what torch
2.15's own modules compute on the same inputs (the script runs served here and natively on 2.15)."""

from conftest import (clean_env, import_with_torchpatch, only_torch, run_json, run_newest_torch_json, run_py,
                      where_patch_applies)

LAYOUTS = """
import json, torch
from torch.distributed._pycute import Layout, coalesce, complement, composition, filter, make_layout, crd2idx, idx2crd, suffix_product
from torch.distributed._mesh_layout import _FlatLayout, _MeshLayout
cases = [((2, 3), (3, 1)), ((2, 3), (1, 2)), ((4, 2), (2, 1)), ((2, 2, 2), (4, 2, 1)), ((2, (2, 2)), (8, (2, 1))),
         ((4, 1, 2), (1, 7, 8)), ((1,), (0,)), ((2, 4), (1, 2))]
out = {}
for shape, stride in cases:
    layout = Layout(shape, stride)
    key = str((shape, stride))
    flat = _FlatLayout(shape, stride)
    out[key] = {
        "coalesce": str(coalesce(layout)), "filter": str(filter(layout)), "cosize": layout.cosize(),
        "complement16": str(complement(layout, 16)), "calls": [layout(i) for i in range(layout.size())],
        "idx2crd": str(idx2crd(5, shape)), "crd2idx": crd2idx(3, shape, stride), "suffix": str(suffix_product(shape)),
        "flat": [flat.shape, flat.stride, flat.numel(), flat.all_ranks_from_zero(), flat.check_sorted(),
                 flat.check_orthogonal(), list(flat.sizes_and_strides)],
    }
    if flat.check_orthogonal() and flat.numel() <= 16 and max(flat.all_ranks_from_zero() or [0]) < 16:
        try:
            out[key]["global16"] = flat.global_ranks(16)
        except AssertionError:
            out[key]["global16"] = "AssertionError"
for a, b in [(((6, 2), (2, 1)), ((3,), (2,))), (((8,), (1,)), ((2, 4), (4, 1))), (((4, 4), (4, 1)), ((2, 2), (1, 2)))]:
    out[str((a, b))] = [str(composition(Layout(*a), Layout(*b))),
                        str(_FlatLayout(*a).composition(_MeshLayout.from_sizes_strides(*b)))]
mesh = _MeshLayout.from_sizes_strides((2, 2, 2))
out["mesh"] = [mesh.top_level_sizes, mesh.numel(), mesh.cosize(), str(mesh.collapse()), len(mesh), str(mesh[1:]),
               str(mesh.splice(1, 2, _MeshLayout.from_sizes_strides((1, 2), (4, 1)))), str(mesh.to_pycute()),
               mesh.remap_to_tensor(torch.arange(10, 18)).tolist(), mesh[0:1].remap_to_tensor(torch.arange(8)).tolist(),
               str(make_layout(Layout(2, 1), Layout(3, 2)))]
errors = []
for bad in [lambda: _FlatLayout((2, 3), (1,)), lambda: _FlatLayout("x"), lambda: len(_FlatLayout(4)),
            lambda: _MeshLayout.from_sizes_strides((2, 2), (1,))]:
    try:
        bad()
        errors.append(None)
    except Exception as exc:
        errors.append([type(exc).__name__, str(exc)])
out["errors"] = errors
out["equal"] = [_FlatLayout((2, 2), (2, 1)) == _FlatLayout(4, 1), hash(_FlatLayout((2, 2), (2, 1))) == hash(_FlatLayout((4,), (1,))),
                _FlatLayout((1,), (5,)).shape]
print(json.dumps(out))
"""

INDICES = """
import json
from torch.distributed._local_tensor._c10d import _indices_to_layout
from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
out = [_indices_to_layout(r) for r in ([0], [], [0, 1, 2, 3], [0, 2, 4, 6], [0, 1, 4, 5], [0, 4, 8, 1, 5, 9][:3], [0, 3, 6, 1][:3])]
try:
    _indices_to_layout([0, 1, 3])
    out.append(None)
except AssertionError as exc:
    out.append(str(exc))
with maybe_disable_local_tensor_mode():
    out.append("entered")
print(json.dumps(out))
"""


@where_patch_applies("mesh-layout")
def test_layout_algebra_matches_newest_torch():
    served = run_json(LAYOUTS, env=clean_env(TORCHPATCH="1"))
    assert served == run_newest_torch_json(LAYOUTS)


@where_patch_applies("local-tensor-helpers")
def test_indices_to_layout_matches_newest_torch():
    served = run_json(INDICES, env=clean_env(TORCHPATCH="1"))
    assert served == run_newest_torch_json(INDICES)


@where_patch_applies("mesh-layout")
def test_modules_missing_natively():
    for module in ("torch.distributed._mesh_layout", "torch.distributed._pycute", "torch.distributed._local_tensor"):
        proc = run_py(f"import {module}")
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


@where_patch_applies("local-tensor-helpers")
def test_local_tensor_itself_is_not_served():
    result = run_json("import json\ntry:\n    from torch.distributed._local_tensor import LocalTensor\n    e = None\n"
                      "except ImportError as exc:\n    e = type(exc).__name__\nprint(json.dumps(e))",
                      env=clean_env(TORCHPATCH="1"))
    assert result == "ImportError"


@only_torch(">=2.10", "torch's own _pycute, _mesh_layout and _local_tensor (before 2.4: none, not served)")
def test_inactive_where_torch_has_the_modules():
    assert import_with_torchpatch("import torch.distributed._pycute, torch.distributed._local_tensor",
                                  "mesh-layout")["error"] is None
    result = run_json("import json, torchpatch, torch.distributed._mesh_layout as m\n"
                      "print(json.dumps([m.__file__, torchpatch.status().get('mesh-layout')]))",
                      env=clean_env(TORCHPATCH="1"))
    assert result[0].endswith("/torch/distributed/_mesh_layout.py")  # torch's own module
