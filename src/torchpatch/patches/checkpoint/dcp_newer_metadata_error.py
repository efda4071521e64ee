"""dcp-newer-metadata-error: a checkpoint of torch 2.3 or newer, which torch 2.0-2.2 cannot read, fails
with an error naming the torch that can, torch 2.0-2.2.

What breaks:   ``dcp.load_state_dict`` on torch 2.0-2.2 of a checkpoint that torch 2.3 or newer saved
               (a job moved back to an older cluster image) fails while reading the checkpoint's
               ``.metadata`` with ``AttributeError: Can't get attribute '_MEM_FORMAT_ENCODING' on
               <module 'torch.distributed.checkpoint.metadata' ...>``, which names neither the
               torch that wrote the file nor what to do: torch 2.3 moved ``TensorProperties`` into
               ``checkpoint.metadata`` with its memory-format encoding, and every checkpoint it or a
               later torch saves pickles them; older torch has neither.
Torch:         2.0-2.2 (2.3 and later read the older and the newer layout; torch 2.15's own sixth
               field is ``dcp-metadata-strides``'s).
Fix:           not served (the metadata needs classes this torch does not have): the unpickling error
               becomes a ``RuntimeError`` saying that torch 2.3 or newer wrote the checkpoint, which
               name it needs that this torch lacks, and the two ways on: load it with torch 2.3 or
               newer, or convert it there to a ``torch.save`` file
               (``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``) that this torch
               loads. The original error is its ``__cause__``.
Upstream:      https://github.com/pytorch/pytorch/pull/116248 (TensorProperties in
               checkpoint.metadata, torch 2.3)
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any, Dict, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="dcp-newer-metadata-error",
    summary="dcp loading on torch 2.0-2.2 of a checkpoint torch 2.3+ saved: an error naming the torch that can read it",
    torch=">=2.0,<2.3",
    upstream="https://github.com/pytorch/pytorch/pull/116248",
    behaviour="reading the metadata of a checkpoint that torch 2.3 or newer saved",
    errors=(
        Error(r"Can't get attribute '_MEM_FORMAT_ENCODING' on <module 'torch\.distributed\.checkpoint\.metadata'",
              "AttributeError: Can't get attribute '_MEM_FORMAT_ENCODING' on <module "
              "'torch.distributed.checkpoint.metadata' ..."),
    ),
)

# "Can't get attribute 'NAME' on <module 'MODULE' from ...>" (pickle), "No module named 'MODULE'"
MISSING = re.compile(r"Can't get attribute '(?P<name>[^']+)' on <module '(?P<module>[^']+)'|No module named '(?P<mod>[^']+)'")


def _explain_newer_metadata(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    try:
        return wrapped(*args, **kwargs)
    except (AttributeError, ImportError) as exc:
        found = MISSING.search(str(exc))
        if not found or not (found["module"] or found["mod"]).startswith("torch.distributed"):
            raise
        import torch

        needed = f"{found['module']}.{found['name']}" if found["name"] else found["mod"]
        raise RuntimeError(
            f"This distributed checkpoint was saved by torch 2.3 or newer: its metadata needs {needed}, which "
            f"torch {torch.__version__} does not have, so this torch cannot read it. Load it with torch 2.3 or "
            "newer, or convert it there with torch.distributed.checkpoint.format_utils.dcp_to_torch_save(dir, "
            "'state.pt') and load that file with torch.load here."
        ) from exc


@PATCH.on_import("torch.distributed.checkpoint.filesystem")
def explain_newer_metadata(patcher: Patcher, filesystem: ModuleType) -> bool:
    from torch.distributed.checkpoint import metadata

    if hasattr(metadata, "_MEM_FORMAT_ENCODING"):
        return False  # torch 2.3+ reads the layout
    patcher.wrap(filesystem.FileSystemReader, "read_metadata", _explain_newer_metadata)
    return True
