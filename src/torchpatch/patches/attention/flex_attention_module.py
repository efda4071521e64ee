"""flex-attention-module: ``torch.nn.attention.flex_attention`` on torch 2.4, computing what torch
2.15's eager FlexAttention computes.

What breaks:   torchtitan 0.1.0 imports FlexAttention at module level in the model every
               configuration uses (``from torch.nn.attention.flex_attention import BlockMask,
               create_block_mask, flex_attention``), so on torch 2.4 nothing imports, not even a
               model that runs plain SDPA attention: ``ModuleNotFoundError: No module named
               'torch.nn.attention.flex_attention'``; code that uses FlexAttention has nothing to call.
Torch:         2.4 has only the private prototype ``torch.nn.attention._flex_attention`` (a score_mod,
               no BlockMask, no create_block_mask, NaN for a row that attends to nothing); the public
               module arrived in 2.5 (``AuxRequest``, ``AuxOutput``, ``FlexKernelOptions`` in 2.9).
Fix:           serve the module with torch 2.15's names and semantics, written in ``attention/_flex``:
               ``BlockMask`` (constructor, ``from_kv_blocks``, ``as_tuple``, ``shape``, ``sparsity``,
               ``to_dense``, ``to_string``, indexing, ``to``), ``create_block_mask``, ``create_mask``,
               ``and_masks``/``or_masks``/``noop_mask``, and ``flex_attention`` as torch computes it
               without torch.compile: the full score matrix, ``score_mod`` and ``mask_mod`` vmapped over
               (batch, head, q_idx, kv_idx), the block mask's blocks, GQA, ``return_lse``/``return_aux``,
               torch's errors (backward on CPU raises, as on 2.15). ``AuxRequest``, ``AuxOutput`` and
               ``FlexKernelOptions`` are the flex-attention-aux patch's. torch.compile cannot give the
               fused kernel on 2.4 (its prototype operator takes no block mask, and 2.4's Inductor fails
               on the vmapped mods): the computation is excluded from compilation
               (``torch._dynamo.disable``), so it runs eagerly, compiled or not.
Upstream:      https://github.com/pytorch/pytorch/pull/130136 (flex_attention public, torch 2.5)
"""

from types import ModuleType

from torchpatch import Patch

PATCH = Patch(
    id="flex-attention-module",
    summary="torch.nn.attention.flex_attention on torch 2.4: BlockMask, create_block_mask, flex_attention "
            "(torch 2.15's eager computation, unfused)",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/130136",
)

_MODULE = "torch.nn.attention.flex_attention"
PUBLIC = ("BlockMask", "flex_attention", "AuxOutput", "AuxRequest", "FlexKernelOptions", "create_block_mask",
          "create_mask", "or_masks", "and_masks", "noop_mask")
# torch 2.15's private constants and helpers that code written for it imports (the default block size,
# for one), with torch's values and semantics (the compile-debug switch is served off: the computation
# here is always the eager one that switch selects)
HELPERS = {"block_mask": ("_DEFAULT_SPARSE_BLOCK_SIZE", "_LARGE_SPARSE_BLOCK_SIZE", "_cdiv", "_ordered_to_dense",
                          "_dense_to_ordered", "_transpose_ordered", "_round_up_to_multiple", "_broadcast_to_dim",
                          "_sliced_mask_mod_error"),
           "attention": ("_BLOCK_MASK_TOO_SMALL_ERROR", "_BLOCK_MASK_TOO_LARGE_ERROR"),
           "mods": ("_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", "_WARNINGS_SHOWN", "_warn_once", "_ModificationType",
                    "_get_mod_type", "_identity")}
PATCH.sets(_MODULE, PUBLIC + ("_mask_mod_signature", "_score_mod_signature") + sum(HELPERS.values(), ()))


@PATCH.module(_MODULE)
def build(module: ModuleType) -> None:
    from torchpatch.patches.attention import flex_attention_aux as aux
    from torchpatch.patches.attention._flex import attention, block_mask, mods

    module.BlockMask, module.create_block_mask = block_mask.BlockMask, block_mask.create_block_mask
    module.flex_attention = attention.flex_attention
    for name in ("create_mask", "or_masks", "and_masks", "noop_mask", "_mask_mod_signature", "_score_mod_signature"):
        setattr(module, name, getattr(mods, name))
    module.AuxRequest, module.AuxOutput = aux.AuxRequest, aux.AuxOutput
    module.FlexKernelOptions = aux._kernel_options()
    module.FlexKernelOptions.__module__ = _MODULE
    sources = {"block_mask": block_mask, "attention": attention, "mods": mods}
    for source, names in HELPERS.items():
        for name in names:
            setattr(module, name, getattr(sources[source], name))
    module.__all__ = list(PUBLIC)
