"""sac-ignored-ops: ``torch.utils.checkpoint.SAC_IGNORED_OPS`` on torch 2.4, as torch 2.4's own set.

What breaks:   code written for torch 2.5+ that extends or consults the ops selective activation
               checkpointing never caches (``from torch.utils.checkpoint import SAC_IGNORED_OPS``)
               dies on torch 2.4 with ``ImportError: cannot import name 'SAC_IGNORED_OPS'``.
Torch:         2.4 keeps the same set (``aten.detach``, ``prim.device`` and FunctionalTensor's
               metadata functions) under the private name ``_ignored_ops``; 2.5 renamed it.
Fix:           serve the very set torch 2.4's selective checkpointing consults, so adding an op to
               it changes what torch 2.4 recomputes, as on torch 2.5+.
Upstream:      https://github.com/pytorch/pytorch/pull/125795 (selective checkpointing public, torch 2.5)
"""

from typing import Any, Set

from torchpatch import Patch

PATCH = Patch(
    id="sac-ignored-ops",
    summary="torch.utils.checkpoint.SAC_IGNORED_OPS on torch 2.4 (its own _ignored_ops)",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/125795",
)


@PATCH.symbol("torch.utils.checkpoint", "SAC_IGNORED_OPS")
def _sac_ignored_ops() -> Set[Any]:
    import torch.utils.checkpoint as checkpoint

    return checkpoint._ignored_ops
