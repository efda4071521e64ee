"""create-block-mask-options: ``create_block_mask(..., separate_full_blocks=True,
compute_dq_write_order=False, dq_kv_order=True)`` and its ``device=None`` default on torch 2.9.

What breaks:   torchtitan 0.3.0 builds its FlexAttention masks with ``create_block_mask(...,
               separate_full_blocks=...)``, so on torch 2.9 a FlexAttention model stops at its first
               forward: ``TypeError: create_block_mask() got an unexpected keyword argument
               'separate_full_blocks'``.
Torch:         2.15's ``create_block_mask`` takes ``separate_full_blocks`` (``False``: every non-empty
               block is a partial block, mask_mod applied to all), ``compute_dq_write_order`` and
               ``dq_kv_order`` (metadata for the deterministic FLASH backward on CUDA) and defaults
               ``device`` to the current accelerator, else CPU; 2.9's always separates full blocks and
               defaults to ``"cuda"``; its ``_convert_mask_to_block_mask`` already takes
               ``separate_full_blocks``. 2.5-2.8 are untested and left alone.
Fix:           replace 2.9's module function (before importers bind it) with one taking 2.15's arguments:
               ``separate_full_blocks=False`` builds the mask from 2.9's own pieces without full blocks
               (eagerly, also where ``_compile=True`` asks for a compiled build: the same mask);
               ``dq_kv_order`` must be a bool (2.15's ``ValueError``); ``compute_dq_write_order=True``
               raises ``NotImplementedError`` (2.9's FLASH backend has no such metadata).
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/nn/attention/flex_attention.py
"""

import inspect
from types import ModuleType
from typing import Any, Callable, Optional

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="create-block-mask-options",
    summary="create_block_mask(separate_full_blocks=..., compute_dq_write_order=..., dq_kv_order=...) and its "
    "device=None default (torch 2.15's options)",
    torch=">=2.9,<2.10",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/nn/attention/flex_attention.py",
    behaviour="create_block_mask(separate_full_blocks=...)",
    errors=(
        Error(r"create_block_mask\(\) got an unexpected keyword argument 'separate_full_blocks'",
              "TypeError: create_block_mask() got an unexpected keyword argument 'separate_full_blocks'"),
    ),
)


def _with_options(flex: ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    def create_block_mask(mask_mod: Callable[..., Any], B: Optional[int], H: Optional[int], Q_LEN: int,
                          KV_LEN: int, device: Any = None, BLOCK_SIZE: Any = flex._DEFAULT_SPARSE_BLOCK_SIZE,
                          _compile: bool = False, separate_full_blocks: bool = True,
                          compute_dq_write_order: bool = False, dq_kv_order: bool = True) -> Any:
        import torch

        if compute_dq_write_order:
            raise NotImplementedError("create_block_mask(compute_dq_write_order=True) is torch 2.15's metadata for "
                                      "the deterministic FLASH backward, which this torch does not have")
        if not isinstance(dq_kv_order, bool):
            raise ValueError("dq_kv_order must be a bool when using create_block_mask")
        if device is None:
            device = torch.accelerator.current_accelerator() or "cpu"
        if separate_full_blocks:
            return original(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, _compile)
        q_block, kv_block = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
        mask = flex.create_mask(mask_mod, 1 if B is None else B, 1 if H is None else H, Q_LEN, KV_LEN, device)
        blocks = flex._convert_mask_to_block_mask(mask, Q_BLOCK_SIZE=q_block, KV_BLOCK_SIZE=kv_block,
                                                  separate_full_blocks=False)
        return flex._create_sparse_block_from_block_mask(blocks, mask_mod, (Q_LEN, KV_LEN), q_block, kv_block)

    # torch's name and module, as a wrapper has (not __wrapped__: the signature is 2.15's, not the original's)
    create_block_mask.__doc__, create_block_mask.__module__ = original.__doc__, original.__module__
    return create_block_mask


@PATCH.on_import("torch.nn.attention.flex_attention")
def take_options(patcher: Patcher, flex: ModuleType) -> Optional[bool]:
    original = flex.create_block_mask
    if "separate_full_blocks" in inspect.signature(original).parameters:
        return False
    patcher.setattr(flex, "create_block_mask", _with_options(flex, original))
    return True
