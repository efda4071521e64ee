"""torch-typing-names: ``torch.Any``, ``torch.Optional`` and the other ``typing`` names that
torch's namespace used to leak, torch 1.13 and later.

What breaks:   code annotated with ``torch.Any`` (Open-Sora's communication helpers; editors
               autocomplete it) dies at import with
               ``AttributeError: module 'torch' has no attribute 'Any'``.
Torch:         ``torch/__init__.py`` did ``from typing import ...`` without underscores until 2.4:
               1.13 exposed ``Any``, ``Callable``, ``Set``, ``Union``; 2.1 to 2.4 also ``Dict``,
               ``List``, ``Optional``, ``Tuple``; from 2.5 none of them. (``torch.Type`` is
               ``torch._C.Type``, the TorchScript type, on every version, and is left alone.)
Fix:           once torch is imported, set each of the eight names torch lacks to the ``typing``
               object itself; names torch has are untouched. They are set, not served through a
               module ``__getattr__``: on torch 1.13, which has none of its own, adding one makes
               CPython stop specialising *every* ``torch.X`` lookup (about 1.8x slower
               ``torch.float32`` on Python 3.11), while a plain attribute costs nothing.
Upstream:      not restored in torch; the report: https://github.com/Vahe1994/AQLM/issues/136
               (``torch.Any`` fails from torch 2.5).
"""

import typing
from types import ModuleType

from torchpatch import Patch, Patcher

NAMES = ("Any", "Callable", "Dict", "List", "Optional", "Set", "Tuple", "Union")

PATCH = Patch(
    id="torch-typing-names",
    summary="torch.Any, torch.Optional, ... (the typing names torch <=2.4 leaked) where torch lacks them",
    torch=">=1.13",
    upstream="https://github.com/Vahe1994/AQLM/issues/136",
    behaviour="torch." + "/".join(NAMES) + " = typing's, where missing",
)
PATCH.sets("torch", NAMES)


@PATCH.on_import("torch")
def set_typing_names(patcher: Patcher, torch: ModuleType) -> bool:
    missing = [name for name in NAMES if name not in vars(torch)]
    for name in missing:
        patcher.setattr(torch, name, getattr(typing, name))
    return bool(missing)
