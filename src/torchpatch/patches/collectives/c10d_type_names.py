"""c10d-type-names: the type names ``torch.distributed.GroupName`` (torch 2.4-2.9) and
``torch.distributed.RankType`` (torch 2.4-2.10).

What breaks:   code written for newer torch annotates with them at module level, e.g.
               ``def resolve(name: dist.GroupName, rank: dist.RankType)``, and its import dies on older
               torch with ``AttributeError: module 'torch.distributed' has no attribute 'GroupName'``
               (``RankType`` likewise).
Torch:         2.10 added ``GroupName = NewType("GroupName", str)`` in ``distributed_c10d`` (exported by
               ``torch.distributed``: the type of a process group's name), 2.11 ``RankType = int |
               torch.SymInt`` in ``torch.distributed``; torch 2.4 has ``torch.SymInt``.
Fix:           serve ``GroupName`` in ``torch.distributed.distributed_c10d`` and ``torch.distributed``
               (one object: a ``NewType`` of ``str`` named ``GroupName``, of module
               ``torch.distributed.distributed_c10d``, which returns its argument when called) and
               ``RankType`` in ``torch.distributed`` as ``typing.Union[int, torch.SymInt]``, which
               compares equal to torch's ``int | torch.SymInt``.
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/distributed_c10d.py
               (``GroupName``), https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/__init__.py
               (``RankType``)
"""

from __future__ import annotations

import functools
from typing import Any

from torchpatch import Patch

PATCH = Patch(
    id="c10d-type-names",
    summary="torch.distributed.GroupName (2.4-2.9) and torch.distributed.RankType (2.4-2.10)",
    torch=">=2.4,<2.11",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/distributed_c10d.py",
)


@functools.lru_cache(maxsize=None)
def group_name_type() -> Any:
    """``NewType("GroupName", str)``, made once: both modules serve the same object."""
    from typing import NewType

    group_name = NewType("GroupName", str)
    group_name.__module__ = "torch.distributed.distributed_c10d"
    return group_name


@PATCH.symbol("torch.distributed", "RankType")
def rank_type() -> Any:
    from typing import Union

    import torch

    return Union[int, torch.SymInt]


for _module in ("torch.distributed.distributed_c10d", "torch.distributed"):
    PATCH.symbol(_module, "GroupName")(group_name_type)
