"""mesh-layout: ``torch.distributed._pycute`` and ``torch.distributed._mesh_layout`` (``_FlatLayout``,
``_MeshLayout``) on torch 2.4-2.9.

What breaks:   the spmd_types package (0.2.3; torchtitan 0.3.0 imports it everywhere) describes mesh
               axes with torch's rank layouts and dies at import on torch 2.9 and older with
               ``ModuleNotFoundError: No module named 'torch.distributed._mesh_layout'``.
Torch:         2.10 added the CuTe layout algebra ``torch.distributed._pycute`` and ``_mesh_layout``
               (a ``_MeshLayout`` that was a pycute ``Layout``); 2.13 split it into ``_FlatLayout`` (one
               mesh axis, canonical: coalesced and flat) and ``_MeshLayout`` (a sequence of them), as in
               2.15. 2.4-2.9 have neither module (pure-Python bookkeeping: nothing in them needs newer
               torch).
Fix:           serve both modules with torch 2.15's semantics, written in ``device_mesh/_layout``:
               ``_FlatLayout`` and ``_MeshLayout`` complete, and ``_pycute``'s algebra (the int-tuple
               helpers, ``Layout``, ``make_layout``, ``size``, ``cosize``, ``coalesce``, ``filter``,
               ``composition``, ``complement``, the inverses, divides and products,
               ``slice_and_offset``). Not served: calling a ``Layout`` with ``None`` coordinates (no
               device-mesh code does: it raises ``NotImplementedError``; ``slice_and_offset`` slices).
               These torch versions' ``DeviceMesh`` does not keep a ``_layout``: the modules are for
               code that computes with layouts itself (spmd_types' ``MeshAxis``).
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/_mesh_layout.py
"""

from types import ModuleType

from torchpatch import Patch

PATCH = Patch(
    id="mesh-layout",
    summary="torch.distributed._pycute and torch.distributed._mesh_layout (_FlatLayout, _MeshLayout): torch "
    "2.15's rank-layout algebra, for spmd_types",
    torch=">=2.4,<2.10",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/_mesh_layout.py",
)

PYCUTE = "torch.distributed._pycute"
MESH_LAYOUT = "torch.distributed._mesh_layout"
PYCUTE_NAMES = ("IntTuple", "Integer", "is_int", "is_tuple", "as_tuple", "match_structure", "flatten", "product",
                "suffix_product", "idx2crd", "crd2idx", "signum", "inner_product", "tuple_max", "elem_scale",
                "shape_div", "crd2crd", "slice_", "has_none", "LayoutBase", "is_layout", "Layout", "make_layout",
                "size", "cosize", "coalesce", "filter", "composition", "complement", "right_inverse", "left_inverse",
                "logical_divide", "logical_product", "zipped_divide", "tiled_divide", "zipped_product",
                "tiled_product", "slice_and_offset")
PATCH.sets(PYCUTE, PYCUTE_NAMES)
PATCH.sets(MESH_LAYOUT, ("_FlatLayout", "_MeshLayout"))


@PATCH.module(PYCUTE)
def build_pycute(module: ModuleType) -> None:
    from torchpatch.patches.device_mesh._layout import pycute

    for name in PYCUTE_NAMES:
        setattr(module, name, getattr(pycute, name))


@PATCH.module(MESH_LAYOUT)
def build_mesh_layout(module: ModuleType) -> None:
    from torchpatch.patches.device_mesh._layout import mesh_layout

    module._FlatLayout, module._MeshLayout = mesh_layout._FlatLayout, mesh_layout._MeshLayout
