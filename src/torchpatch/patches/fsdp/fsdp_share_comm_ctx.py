"""fsdp-share-comm-ctx: ``torch.distributed.fsdp.share_comm_ctx(modules)``, torch 2.4-2.9.

What breaks:   pipeline-parallel code written for torch >= 2.10 (torchtitan 2025-26) makes each model
               chunk an FSDP root and lets them share FSDP2's streams with
               ``from torch.distributed.fsdp import share_comm_ctx``, which dies with ``ImportError:
               cannot import name 'share_comm_ctx' from 'torch.distributed.fsdp'``.
Torch:         2.4-2.9 have FSDP2's communication context (``FSDPState._comm_ctx``, each parameter
               group's ``comm_ctx``: the all-gather, reduce-scatter and all-reduce streams and their
               state), which a root hands to its whole tree at lazy init, but no public way to share
               one across roots; 2.10 added the function.
Fix:           serve ``share_comm_ctx(modules)`` with 2.10's semantics: an empty list does nothing; an
               element that is not an ``FSDPModule`` raises ``ValueError("Expects list of FSDPModules
               but got ...")``; otherwise every module's FSDP state and parameter group takes the first
               module's context, which each root's lazy init then hands to its own tree. On 2.4-2.5
               ``FSDPModule`` is ``torch.distributed._composable.fsdp``'s (public there through the
               ``fsdp-public`` patch).
Upstream:      https://github.com/pytorch/pytorch/tree/v2.10.0/torch/distributed/fsdp/_fully_shard/_fully_shard.py
"""

from __future__ import annotations

from typing import Any, Callable, List

from torchpatch import Patch
from torchpatch.patches._reexport import reexport

PATCH = Patch(
    id="fsdp-share-comm-ctx",
    summary="torch.distributed.fsdp.share_comm_ctx (several FSDP2 roots share one communication context)",
    torch=">=2.4,<2.10",
    upstream="https://github.com/pytorch/pytorch/tree/v2.10.0/torch/distributed/fsdp/_fully_shard/_fully_shard.py",
)


def make_share_comm_ctx(fsdp_module: type) -> Callable[[List[Any]], None]:
    """``share_comm_ctx`` for the installed torch's ``FSDPModule``."""

    def share_comm_ctx(modules: List[Any]) -> None:
        """Let the FSDP modules ``modules`` (e.g. the pipeline chunks on a rank, each an FSDP root) share
        the first one's communication context: its streams for all-gather, reduce-scatter and
        all-reduce."""
        if len(modules) == 0:
            return
        for module in modules:
            if not isinstance(module, fsdp_module):
                raise ValueError(f"Expects list of FSDPModules but got {module}")
        states = [module._get_fsdp_state() for module in modules]
        comm_ctx = states[0]._comm_ctx
        for state in states[1:]:
            state._comm_ctx = comm_ctx
            if state._fsdp_param_group is not None:
                state._fsdp_param_group.comm_ctx = comm_ctx

    return share_comm_ctx


@PATCH.symbol("torch.distributed.fsdp", "share_comm_ctx")
def serve_share_comm_ctx() -> Callable[[List[Any]], None]:
    try:
        from torch.distributed.fsdp._fully_shard import FSDPModule  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import FSDPModule

    return make_share_comm_ctx(FSDPModule)


# torch 2.15 defines it in _fully_shard._fully_shard and re-exports it in each package above
for _module in ("torch.distributed.fsdp._fully_shard", "torch.distributed.fsdp._fully_shard._fully_shard"):
    PATCH.symbol(_module, "share_comm_ctx")(reexport("torch.distributed.fsdp", "share_comm_ctx"))
