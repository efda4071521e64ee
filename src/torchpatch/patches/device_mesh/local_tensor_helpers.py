"""local-tensor-helpers: ``torch.distributed._local_tensor`` with what code outside LocalTensor
imports from it (``local_tensor_mode``, ``maybe_disable_local_tensor_mode``,
``_c10d._indices_to_layout``) on torch 2.4-2.9.

What breaks:   the spmd_types package (0.2.3; torchtitan 0.3.0 imports it everywhere) dies at import on
               torch 2.9 and older with ``ModuleNotFoundError: No module named
               'torch.distributed._local_tensor'`` (``from torch.distributed._local_tensor._c10d import
               _indices_to_layout``; its checker imports ``maybe_disable_local_tensor_mode``).
Torch:         2.10 added ``torch.distributed._local_tensor``: ``LocalTensor``/``LocalTensorMode`` (a
               simulator that runs every rank's tensor in one process), its collectives in ``_c10d``
               and helpers; 2.4-2.9 have none of it.
Fix:           serve the package with the helpers only, as 2.15 computes them: ``_c10d._indices_to_layout``
               (a sorted rank list as a (shape, stride) grid, 2.15's errors), ``local_tensor_mode()``
               (``None``: no ``LocalTensorMode`` exists here) and ``maybe_disable_local_tensor_mode()``
               (then a no-op context). Not served: ``LocalTensor``, ``LocalTensorMode`` and the rest of the
               simulator (3,300 lines of torch 2.15 for single-process testing; real training never uses
               it): importing them raises ``ImportError``, which spmd_types catches to run without.
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/_local_tensor
"""

from types import ModuleType

from torchpatch import Patch

PATCH = Patch(
    id="local-tensor-helpers",
    summary="torch.distributed._local_tensor's helpers (_c10d._indices_to_layout, local_tensor_mode, "
    "maybe_disable_local_tensor_mode), without LocalTensor itself: for spmd_types",
    torch=">=2.4,<2.10",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/_local_tensor",
)

PACKAGE = "torch.distributed._local_tensor"
PATCH.sets(PACKAGE, ("local_tensor_mode", "maybe_disable_local_tensor_mode"))
PATCH.sets(f"{PACKAGE}._c10d", ("_indices_to_layout",))


@PATCH.module(PACKAGE)
def build_package(module: ModuleType) -> None:
    from torchpatch.patches.device_mesh._layout import local_tensor

    module.local_tensor_mode = local_tensor.local_tensor_mode
    module.maybe_disable_local_tensor_mode = local_tensor.maybe_disable_local_tensor_mode


@PATCH.module(f"{PACKAGE}._c10d")
def build_c10d(module: ModuleType) -> None:
    from torchpatch.patches.device_mesh._layout import local_tensor

    module._indices_to_layout = local_tensor._indices_to_layout
