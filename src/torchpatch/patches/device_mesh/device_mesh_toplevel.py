"""device-mesh-toplevel: ``torch.distributed.DeviceMesh`` and ``init_device_mesh`` on torch 2.1.

What breaks:   code written for torch >= 2.2 (torchtitan: ``from torch.distributed import DeviceMesh``)
               dies on torch 2.1 with ``ImportError: cannot import name 'DeviceMesh' from
               'torch.distributed'`` (``AttributeError: module 'torch.distributed' has no attribute
               'DeviceMesh'`` for ``dist.DeviceMesh``).
Torch:         2.1 has DeviceMesh only as ``torch.distributed._tensor.device_mesh.DeviceMesh`` (and
               ``init_device_mesh`` there); 2.2 re-exported both from ``torch.distributed``. 1.13 has no
               DeviceMesh at all (no ``torch.distributed._tensor``): nothing is served there, the name
               stays an ``AttributeError``/``ImportError`` so that ``try``/``except ImportError``
               fallbacks keep working.
Fix:           serve ``torch.distributed.DeviceMesh`` and ``torch.distributed.init_device_mesh`` as the
               very objects of ``torch.distributed._tensor.device_mesh``, imported on first access
               (dtensor-public serves the module itself as ``torch.distributed.device_mesh``). Served
               through ``torch.distributed``'s module ``__getattr__``, which torch 2.1 does not define
               itself: on Python 3.11+ attribute look-ups on ``torch.distributed`` lose the
               interpreter's specialisation (nanoseconds; they are not in hot loops).
Upstream:      https://github.com/pytorch/pytorch/pull/112364 (DeviceMesh out of ``_tensor``, torch 2.2)
"""

from typing import Any, Callable

from torchpatch import Patch

PATCH = Patch(
    id="device-mesh-toplevel",
    summary="torch.distributed.DeviceMesh and torch.distributed.init_device_mesh",
    torch=">=2.1,<2.2",
    upstream="https://github.com/pytorch/pytorch/pull/112364",
)


def _from_device_mesh(name: str) -> Callable[[], Any]:
    def factory() -> Any:
        import torch.distributed._tensor.device_mesh as device_mesh

        return getattr(device_mesh, name)

    return factory


for _name in ("DeviceMesh", "init_device_mesh"):
    PATCH.symbol("torch.distributed", _name)(_from_device_mesh(_name))
