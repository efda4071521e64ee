"""set-timeout: ``torch.distributed.set_timeout(timeout, group=None)`` (and
``torch.distributed.distributed_c10d.set_timeout``) on torch 2.9-2.13.

What breaks:   torchtitan 0.3 (September 2026) shortens every process group's timeout after its
               first training step with ``torch.distributed.set_timeout(timeout, group)``; on torch
               2.13 and older the first step trains and the second dies with ``AttributeError: module
               'torch.distributed' has no attribute 'set_timeout'``.
Torch:         2.9-2.13 have the same operation as the private ``distributed_c10d._set_pg_timeout(
               timeout, group=None)`` (it sets the timeout of the group's gloo and NCCL backends);
               2.14 made it public as ``set_timeout``, which forwards to every backend of the group,
               and deprecated the private name. torch 2.4 has ``_set_pg_timeout`` too, but a gloo
               group's collectives do not use the timeout it sets (measured: a lone all_reduce still
               waits the 60 s the group was made with, not the 2 s set), so nothing is served there;
               2.5-2.8 are untested and left alone.
Fix:           serve ``torch.distributed.set_timeout`` and ``torch.distributed.distributed_c10d.set_timeout``
               (where 2.14 defines it) as this torch's ``_set_pg_timeout`` (the very function, resolved
               on first access). For gloo and NCCL groups it does what 2.14's does;
               other backends (MPI, UCC) keep their timeout, which 2.14 also leaves unchanged (with a
               warning). Served through the modules' ``__getattr__``, which these versions do not define
               themselves.
Upstream:      torch 2.14 (``torch.distributed.set_timeout``; ``_set_pg_timeout`` deprecated), see
               https://github.com/pytorch/pytorch/tree/v2.14.1/torch/distributed/distributed_c10d.py
"""

from typing import Any

from torchpatch import Patch

PATCH = Patch(
    id="set-timeout",
    summary="torch.distributed.set_timeout(timeout, group) on torch 2.9-2.13 (their _set_pg_timeout)",
    torch=">=2.9,<2.14",
    upstream="https://github.com/pytorch/pytorch/tree/v2.14.1/torch/distributed/distributed_c10d.py",
)


def set_timeout() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._set_pg_timeout


for _module in ("torch.distributed.distributed_c10d", "torch.distributed"):
    PATCH.symbol(_module, "set_timeout")(set_timeout)
