"""c10d-backend-queries: ``get_backend_impl`` (torch 2.4-2.13), ``get_default_backend_for_device`` and
``is_xccl_available`` (torch 2.4-2.5) in ``torch.distributed``.

What breaks:   code written for newer torch asks which backend serves a device or reaches the backend
               object of a group, and dies on older torch with ``AttributeError: module
               'torch.distributed' has no attribute 'get_backend_impl'`` (2.13 and older),
               ``... 'get_default_backend_for_device'`` or ``... 'is_xccl_available'`` (2.5 and older).
Torch:         2.6 added ``get_default_backend_for_device(device)`` (the backend of
               ``Backend.default_device_backend_map`` for the device's type, ``ValueError`` when none
               is registered) and ``is_xccl_available()`` (whether the XCCL backend, the XPU one, is
               built in: ``ProcessGroupXCCL``, which no torch before 2.6 has); 2.14 added
               ``get_backend_impl(group=None, device=None)``: the ``torch._C._distributed_c10d.Backend``
               of a group (given as a ProcessGroup or its name) for ``device``, else for its bound
               device, else the one backend its devices share (``ValueError`` when they have several).
               Every torch from 2.4 has what these read: ``Backend.default_device_backend_map``,
               ``ProcessGroup._get_backend``, ``bound_device_id``, ``_device_types`` and
               ``_resolve_process_group``.
Fix:           serve each, in ``torch.distributed.distributed_c10d`` and ``torch.distributed``, computed
               as torch 2.15 computes it from those, with its errors.
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/distributed_c10d.py
               (``get_backend_impl``, ``get_default_backend_for_device``, ``is_xccl_available``)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from torchpatch import Patch

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

MODULES = ("torch.distributed.distributed_c10d", "torch.distributed")

PATCH = Patch(
    id="c10d-backend-queries",
    summary="torch.distributed.get_backend_impl (2.4-2.13), get_default_backend_for_device and "
    "is_xccl_available (2.4-2.5)",
    torch=">=2.4,<2.14",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/distributed_c10d.py",
)


def is_xccl_available() -> bool:
    """Check if the XCCL backend is available."""
    import torch

    return hasattr(torch._C._distributed_c10d, "ProcessGroupXCCL")


def get_default_backend_for_device(device: Union[str, "torch.device"]) -> str:
    """The default backend for ``device``'s type, as a lower case string."""
    import torch
    from torch.distributed import Backend

    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    backend = Backend.default_device_backend_map.get(device_type)
    if backend is None:
        raise ValueError(f"Default backend not registered for device : {device}")
    return backend


def get_backend_impl(group: Union[str, "ProcessGroup", None] = None,
                     device: Optional["torch.device"] = None) -> Any:
    """The ``torch._C._distributed_c10d.Backend`` of ``group`` (a ProcessGroup or its name; default:
    the default group) for ``device``; without one, for the group's bound device, else the backend
    its devices share."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    if isinstance(group, str):
        pg = c10d._resolve_process_group(group)
    else:
        pg = group or c10d._get_default_group()
    if c10d._rank_not_in_group(pg):
        raise ValueError("Invalid process group specified")
    if device is None:
        device = pg.bound_device_id
    if device is not None:
        return pg._get_backend(device)
    devices = pg._device_types
    if not devices:
        return pg._get_backend(torch.device("cpu"))
    backend = pg._get_backend(devices[0])
    if any(pg._get_backend(other) is not backend for other in devices[1:]):
        raise ValueError("Process group has multiple backend implementations; pass the device argument to select one.")
    return backend


def _serve(fn: Callable[..., Any]) -> Callable[[], Callable[..., Any]]:
    return lambda: fn


for _module in MODULES:
    for _fn in (is_xccl_available, get_default_backend_for_device, get_backend_impl):
        PATCH.symbol(_module, _fn.__name__)(_serve(_fn))
