"""set-timeout-gloo-24: ``torch.distributed.set_timeout(timeout, group=None)`` (and
``torch.distributed.distributed_c10d.set_timeout``) on torch 2.4, where gloo keeps its timeout.

What breaks:   torchtitan 0.3 shortens every process group's timeout after its first training step with
               ``torch.distributed.set_timeout(timeout, group)``; on torch 2.4 the first step trains and the
               second dies with ``AttributeError: module 'torch.distributed' has no attribute 'set_timeout'``.
Torch:         2.14 made it public: it forwards the timeout to every backend of the group, and a backend
               that cannot change its timeout (MPI, UCC) keeps it, with a warning. 2.4 has the private
               ``_set_pg_timeout``, which sets an NCCL backend's timeout, but a gloo group's collectives
               do not use the timeout it sets (measured: a lone all_reduce still waits the 60 s the group
               was made with, not the 2 s set; set-timeout, for 2.9-2.13, says more).
Fix:           serve ``set_timeout`` as 2.4's ``_set_pg_timeout`` followed, where the group has a gloo
               backend, by 2.14's treatment of a backend that keeps its timeout: a warning naming it. The
               timeout of a gloo group does not change (the group still times out, after its original
               timeout).
Upstream:      https://github.com/pytorch/pytorch/tree/v2.14.1/torch/distributed/distributed_c10d.py
"""

from typing import Any

from torchpatch import Patch

PATCH = Patch(
    id="set-timeout-gloo-24",
    summary="torch.distributed.set_timeout(timeout, group) on torch 2.4: _set_pg_timeout; gloo keeps its timeout, "
            "with torch 2.14's warning for such a backend",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/tree/v2.14.1/torch/distributed/distributed_c10d.py",
)


def set_timeout(timeout: Any, group: Any = None) -> None:
    """2.14's ``set_timeout`` on 2.4: this torch's ``_set_pg_timeout``; its gloo backend keeps the timeout the
    group was made with, which 2.14 warns of for a backend that cannot change it."""
    import warnings

    import torch
    from torch.distributed import distributed_c10d as c10d

    c10d._set_pg_timeout(timeout, group)
    group = c10d._get_default_group() if group is None else group
    if torch.device("cpu") in group._device_types and c10d.is_gloo_available():
        warnings.warn(f"set_timeout: torch {torch.__version__}'s gloo backend keeps the timeout its process group "
                      "was created with (its collectives do not read a changed timeout)", stacklevel=2)


def _served() -> Any:
    set_timeout.__module__ = "torch.distributed.distributed_c10d"
    return set_timeout


for _module in ("torch.distributed.distributed_c10d", "torch.distributed"):
    PATCH.symbol(_module, "set_timeout")(_served)
