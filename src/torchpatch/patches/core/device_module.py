"""device-module: ``torch._utils._get_device_module`` (the ``torch.<device>`` module of a device
type), torch 1.13-2.0.

What breaks:   torchtitan (early 2025) does, at module load,
               ``from torch._utils import _get_available_device_type, _get_device_module`` to find
               ``torch.cuda`` (or ``torch.xpu``, ...) for the device it runs on; on torch 1.13 every
               module importing it dies with ``ImportError: cannot import name '_get_device_module'
               from 'torch._utils'``.
Torch:         1.13 has ``_get_available_device_type`` but not ``_get_device_module``; 2.1 (the next
               torch of the matrix) has it. Served only where missing, so never on 2.1 and later.
Fix:           serve ``_get_device_module(device_type)`` with torch 2.13's semantics: the attribute
               ``torch.<device_type>`` (``torch.cuda`` for ``"cuda"``), and for a device type
               without such a module the ``RuntimeError`` torch raises.
Upstream:      https://github.com/pytorch/pytorch/blob/v2.1.0/torch/_utils.py (the function in torch
               2.1; 2.13's body is the same)
"""

from types import ModuleType

from torchpatch import Patch

PATCH = Patch(
    id="device-module",
    summary="torch._utils._get_device_module (torch.cuda for 'cuda', ...)",
    torch="<2.1",
    upstream="https://github.com/pytorch/pytorch/blob/v2.1.0/torch/_utils.py",
)


def _get_device_module(device_type: str) -> ModuleType:
    """The module ``torch.<device_type>`` (``torch.cuda`` for ``"cuda"``)."""
    import torch

    device_module = getattr(torch, device_type, None)
    if device_module is None:
        raise RuntimeError(
            f"Device '{device_type}' does not have a corresponding module registered as 'torch.{device_type}'."
        )
    return device_module


@PATCH.symbol("torch._utils", "_get_device_module")
def serve_get_device_module() -> object:
    return _get_device_module
