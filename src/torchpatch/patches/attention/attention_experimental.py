"""attention-experimental: the (empty) ``torch.nn.attention.experimental`` package on torch 2.4-2.5.

What breaks:   ``import torch.nn.attention.experimental`` (code that probes for it, or imports it
               before its private submodules) dies on torch 2.4-2.5 with ``ModuleNotFoundError: No
               module named 'torch.nn.attention.experimental'``.
Torch:         2.6 added the package; up to 2.15 it has no public name (its body is a comment; its
               private submodules hold paged attention and quantized SDPA prototypes).
Fix:           serve the package as torch 2.15 has it: importable, with no public names. Its private
               submodules are not served (torch's own prototypes, not public API).
Upstream:      https://github.com/pytorch/pytorch/pull/137164 (paged attention, torch 2.6)
"""

from types import ModuleType

from torchpatch import Patch

PATCH = Patch(
    id="attention-experimental",
    summary="torch.nn.attention.experimental, an empty package as in torch 2.15",
    torch=">=2.4,<2.6",
    upstream="https://github.com/pytorch/pytorch/pull/137164",
)


@PATCH.module("torch.nn.attention.experimental")
def build(module: ModuleType) -> None:
    module.__doc__ = "Experimental attention features (none public); served by torchpatch as in torch 2.15."
