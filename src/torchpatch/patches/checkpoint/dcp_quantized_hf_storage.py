"""dcp-quantized-hf-storage: ``torch.distributed.checkpoint.quantized_hf_storage``
(``QuantizedHuggingFaceStorageReader``) on torch 2.4-2.8.

What breaks:   loading a quantized Hugging Face checkpoint (DeepSeek-V3's FP8 weights with
               ``weight_scale_inv`` blocks, gpt-oss's MXFP4 ``_blocks``/``_scales``) into a
               full-precision state dict as written for torch >= 2.9 (``dcp.load(state,
               storage_reader=QuantizedHuggingFaceStorageReader(path))``) dies with
               ``ModuleNotFoundError: No module named
               'torch.distributed.checkpoint.quantized_hf_storage'``.
Torch:         2.9 added the module; 2.4-2.8 lack it.
Fix:           serve the module with the reader (``_quantized_hf``), written here with 2.9+'s
               signature and semantics: the index file's ``weight_map`` pairs ``X.weight`` with
               ``X.weight_scale_inv`` (each ``block_size`` block of the 2-D weight, read in float32,
               times its scale, then cast to ``target_dtype``) and ``X_blocks`` with ``X_scales``
               (MXFP4, planned as ``[..., groups * bytes * 2]``; like 2.15 the planner intersects
               a request with the stored 4-D chunk, so only the first ``groups`` values of a row are
               read, as on 2.15); other tensors are read as they are.
               Its base is the ``HuggingFaceStorageReader`` dcp-hf-storage serves on 2.4-2.7 and,
               on 2.8, whose own ``hf_storage`` has another API, the same reader made for it alone
               (so there it is not a subclass of 2.8's class). Needs the ``safetensors`` package.
Upstream:      https://github.com/pytorch/pytorch/pull/160682 (MXFP4:
               https://github.com/pytorch/pytorch/pull/167672)
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from torchpatch import Patch
from torchpatch.patches._reexport import reexport

PATCH = Patch(
    id="dcp-quantized-hf-storage",
    summary="torch.distributed.checkpoint.quantized_hf_storage.QuantizedHuggingFaceStorageReader (FP8 blocks, MXFP4)",
    torch=">=2.4,<2.9",
    upstream="https://github.com/pytorch/pytorch/pull/160682",
)

MODULE = "torch.distributed.checkpoint.quantized_hf_storage"
PATCH.sets(MODULE, ("QuantizedHuggingFaceStorageReader",))
# torch 2.15's torch.distributed.checkpoint re-exports it
PATCH.symbol("torch.distributed.checkpoint", "QuantizedHuggingFaceStorageReader")(
    reexport(MODULE, "QuantizedHuggingFaceStorageReader"))


def _base_reader() -> Any:
    """The served ``hf_storage`` reader (dcp-hf-storage, 2.4-2.7), else one made for this module."""
    from ._hf_safetensors import MODULE as HF_MODULE, make_classes

    try:
        hf_storage = importlib.import_module(HF_MODULE)
    except ImportError:  # dcp-hf-storage switched off
        hf_storage = None
    if hf_storage is not None and getattr(hf_storage, "__torchpatch__", None) == "dcp-hf-storage":
        return hf_storage.HuggingFaceStorageReader
    return make_classes()[0]


@PATCH.module(MODULE)
def build(module: ModuleType) -> None:
    from ._quantized_hf import make_reader

    module.QuantizedHuggingFaceStorageReader = make_reader(_base_reader())
    module.__all__ = ["QuantizedHuggingFaceStorageReader"]
