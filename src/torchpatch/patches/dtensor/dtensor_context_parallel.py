"""dtensor-context-parallel: ``torch.distributed.tensor.experimental.context_parallel`` on torch 2.5.

What breaks:   code written for torch >= 2.6 (torchtitan's context parallel) does ``from
               torch.distributed.tensor.experimental import context_parallel`` and dies on torch 2.5
               with ``ImportError: cannot import name 'context_parallel' from
               'torch.distributed.tensor.experimental'``.
Torch:         2.5 has it only as ``torch.distributed.tensor.experimental._attention.context_parallel``,
               with the signature torch 2.6-2.15 export (``context_parallel(mesh, *, buffers=None,
               buffer_seq_dims=None, no_restore_buffers=None)``); 2.6 exported it. 2.4 has no context
               parallel that torch 2.15's semantics can be served on (not_backportable.json says why).
               Tested on 2.5.1 by hand (a temporary venv) at a023f3a, not in CI's matrix.
Fix:           serve ``torch.distributed.tensor.experimental.context_parallel`` as the very function of
               torch 2.5's ``_attention`` module, imported on first access.
Upstream:      https://github.com/pytorch/pytorch/pull/137038 (context_parallel exported, torch 2.6)
"""

from typing import Any

from torchpatch import Patch

PATCH = Patch(
    id="dtensor-context-parallel",
    summary="torch.distributed.tensor.experimental.context_parallel (torch 2.5's private one)",
    torch=">=2.5,<2.6",
    upstream="https://github.com/pytorch/pytorch/pull/137038",
)


@PATCH.symbol("torch.distributed.tensor.experimental", "context_parallel")
def _context_parallel() -> Any:
    from torch.distributed.tensor.experimental._attention import context_parallel

    return context_parallel
