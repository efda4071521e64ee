"""torchrun-py311: torch 1.13's ``torchrun`` on Python 3.11.

What breaks:   ``torchrun --nproc_per_node 2 train.py`` (or ``python -m torch.distributed.run``)
               dies before starting any worker with
               ``AttributeError: 'NoneType' object has no attribute 'get'`` (in ``to_map``).
               ``Std.from_str`` in ``torch/distributed/elastic/multiprocessing/api.py`` finds the
               member for ``--redirects``/``--tee`` by iterating the ``Std`` IntFlag; since Python
               3.11, iterating a flag class yields only its single-bit members (OUT, ERR), so
               ``"0"`` (the default, NONE) and ``"3"`` (ALL) map to ``None``.
Torch:         1.13 on Python 3.11 and later; fixed in torch 2.0.
Fix:           replace ``Std.from_str`` with upstream's version, which looks the member up by
               value (``Std(int(v))``): same regexes, same error for anything else. The ``.pth``
               start-up hook runs in the torchrun launcher process too, so ``TORCHPATCH=1
               torchrun ...`` is enough.
Upstream:      https://github.com/pytorch/pytorch/issues/92319 (the Python 3.11 release blocker
               that tracked this fix for torch 2.0); the user report:
               https://github.com/meta-llama/llama/issues/86
"""

import functools
import re
from types import ModuleType
from typing import Any, Callable, Dict, Union

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="torchrun-py311",
    summary="torchrun on Python 3.11: Std.from_str finds NONE and ALL for --redirects/--tee",
    torch="<2.0",
    python=">=3.11",
    upstream="https://github.com/pytorch/pytorch/issues/92319",
    behaviour="torch.distributed.elastic Std.from_str looks members up by value",
)


def _from_str_by_value(original: Callable[..., Any], value_regex: str, mapping_regex: str) -> classmethod:
    """``Std.from_str`` as torch 2.x has it: ``"3"`` -> ``Std.ALL``, ``"0:1,1:2"`` -> ``{0: Std.OUT,
    1: Std.ERR}``; anything else raises ``ValueError``."""

    @functools.wraps(original)
    def from_str(cls: Any, vm: str) -> Union[Any, Dict[int, Any]]:
        if re.match(value_regex, vm):
            return cls(int(vm))
        if re.match(mapping_regex, vm):
            out: Dict[int, Any] = {}
            for item in vm.split(","):
                i, v = item.split(":")
                out[int(i)] = cls(int(v))
            return out
        raise ValueError(f"{vm} does not match: <{value_regex}> or <{mapping_regex}>")

    return classmethod(from_str)


@PATCH.on_import("torch.distributed.elastic.multiprocessing.api")
def fix_from_str(patcher: Patcher, api: ModuleType) -> bool:
    std = api.Std
    if std.from_str("0") is std.NONE and std.from_str("3") is std.ALL:
        return False
    original = vars(std)["from_str"].__func__
    patcher.setattr(std, "from_str", _from_str_by_value(original, api._VALUE_REGEX, api._MAPPING_REGEX))
    return True
