"""c10d-node-local-rank: ``torch.distributed.get_node_local_rank`` on torch 2.1-2.3.

What breaks:   launcher-agnostic training code picks its accelerator with
               ``torch.distributed.get_node_local_rank(fallback_rank=0)`` (the rank within the node,
               for ``torch.cuda.set_device``) and dies on torch 2.3 and older with ``AttributeError:
               module 'torch.distributed' has no attribute 'get_node_local_rank'``.
Torch:         2.4 added it; it reads only the launcher's ``LOCAL_RANK`` environment variable, which
               torchrun sets on every torch.
Fix:           serve it in ``torch.distributed`` as torch 2.15 computes it: ``int(LOCAL_RANK)`` when the
               variable is set, else ``int(fallback_rank)`` when one is given, else torch's
               ``RuntimeError``. (Served only in ``torch.distributed``, the name code calls.)
Upstream:      https://github.com/pytorch/pytorch/blob/v2.15.0/torch/distributed/distributed_c10d.py
               (``get_node_local_rank``)
"""

from __future__ import annotations

import os
from typing import Optional

from torchpatch import Patch

PATCH = Patch(
    id="c10d-node-local-rank",
    summary="torch.distributed.get_node_local_rank (LOCAL_RANK, else fallback_rank)",
    torch=">=2.1,<2.4",
    upstream="https://github.com/pytorch/pytorch/blob/v2.15.0/torch/distributed/distributed_c10d.py",
)


def get_node_local_rank(fallback_rank: Optional[int] = None) -> int:
    """The local rank of this process on its node: ``LOCAL_RANK``, else ``fallback_rank``."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "LOCAL_RANK is not in the environment. Consider passing fallback_rank to allow `get_node_local_rank` to work, "
        "assuming you are not running in a multi-device context and want the code to run locally instead.")


PATCH.symbol("torch.distributed", "get_node_local_rank")(lambda: get_node_local_rank)
