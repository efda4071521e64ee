"""torchpatch: run distributed PyTorch code on the torch you have, with zero code changes.

Activated in every process by ``TORCHPATCH=1`` (through the ``torchpatch.pth`` start-up hook), by
``torchpatch run -- CMD``, or explicitly by :func:`install`. See ``torchpatch --help``.
"""

from ._installation import PatchError
from ._manager import _activate_at_startup, install, is_installed, status, uninstall
from ._plan import PatchPlan, plan
from ._patch import Error, Patch, Patcher
from ._version import __version__

__all__ = [
    "Error",
    "Patch",
    "PatchError",
    "PatchPlan",
    "Patcher",
    "__version__",
    "install",
    "is_installed",
    "plan",
    "status",
    "uninstall",
]
