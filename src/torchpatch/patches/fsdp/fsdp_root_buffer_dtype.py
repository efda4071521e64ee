"""fsdp-root-buffer-dtype: FSDP1 keeps ``MixedPrecision(buffer_dtype=...)`` when the root FSDP
instance manages no parameters, torch 2.1-2.5.

What breaks:   with ``FullyShardedDataParallel(model, auto_wrap_policy=..., mixed_precision=
               MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))`` where the
               policy wraps every module that has parameters (so the root FSDP instance holds none
               itself, a common layout: ``ModuleWrapPolicy({Block})`` over a stack of blocks), every
               forward casts all buffers back to their full-precision dtype. The requested
               ``buffer_dtype`` is silently ignored in training: buffers stay float32, buffer updates
               run in float32, and activations that meet a buffer are promoted to float32, so the
               outputs differ from the same model with a root that has parameters (and from torch
               >= 2.6), with no error or warning.
Torch:         FSDP1's ``_root_pre_forward`` decides whether to force full-precision buffers from the
               root's own handle; a root without a handle took ``True`` (read in 2.1.2's and
               2.4.1's ``fsdp/_runtime_utils.py``). Torch 2.6 asks the child handles instead
               (pytorch#143989), as 2.9.0 does.
Fix:           ``_root_pre_forward`` (as called by ``FullyShardedDataParallel.forward`` and by the
               composable root hook) runs as before; then, on a root without a handle whose child
               handles do not force full precision (eval with ``FSDP_USE_FULL_PREC_IN_EVAL``, or
               ``summon_full_params``), it casts the buffers back to their computation dtypes,
               the owning FSDP instance's ``buffer_dtype``, with torch's own helpers
               (``_get_buffers_and_dtypes_for_computation``, ``_cast_buffers_to_dtype_and_device``),
               which is what torch >= 2.6 keeps them in. A full-precision round trip of a low-precision
               buffer is exact, so the values are those torch >= 2.6 computes. Applied only where
               ``_root_pre_forward`` still forces full precision for a root without a handle (read from
               its source).
Upstream:      https://github.com/pytorch/pytorch/pull/143989 (issue
               https://github.com/pytorch/pytorch/issues/143900)
"""

from typing import Any, Dict, Tuple

from torchpatch import Patch, Patcher
from torchpatch.patches._source import torch_source

PATCH = Patch(
    id="fsdp-root-buffer-dtype",
    summary="FSDP1 keeps MixedPrecision buffer_dtype when the root instance has no parameters (torch < 2.6 cast buffers to full precision every forward)",
    torch=">=2.1,<2.6",
    upstream="https://github.com/pytorch/pytorch/pull/143989",
    behaviour="FullyShardedDataParallel with MixedPrecision(buffer_dtype) and a root without parameters",
    category="correctness",
)

RUNTIME = "torch.distributed.fsdp._runtime_utils"


def _root_pre_forward(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    state = args[0] if args else kwargs["state"]
    module = args[1] if len(args) > 1 else kwargs["module"]
    if not state._is_root or state._handle:
        return result
    import sys

    runtime = sys.modules[RUNTIME]
    from torch.distributed.fsdp import _traversal_utils

    if any(handle._force_full_precision for handle in _traversal_utils._get_fsdp_handles(module)):
        return result  # a child asks for full precision (eval with full precision, summon_full_params)
    buffers, dtypes = runtime._get_buffers_and_dtypes_for_computation(state, module)
    if buffers and any(dtype is not None and buffer.dtype != dtype for buffer, dtype in zip(buffers, dtypes)):
        runtime._cast_buffers_to_dtype_and_device(buffers, dtypes, state.compute_device)
    return result


def _forces_full_precision_without_handle(runtime: Any) -> bool:
    return "should_cast_buffers_to_full_prec = True" in torch_source(runtime._root_pre_forward)


@PATCH.on_import(RUNTIME)
def keep_buffer_dtype(patcher: Patcher, runtime: Any) -> bool:
    if not hasattr(runtime, "_root_pre_forward") or not _forces_full_precision_without_handle(runtime):
        return False  # torch >= 2.6 asks the child handles itself
    patcher.wrap(runtime, "_root_pre_forward", _root_pre_forward)
    return True


@PATCH.on_import("torch.distributed.fsdp.fully_sharded_data_parallel")
def keep_buffer_dtype_in_forward(patcher: Patcher, fsdp: Any) -> bool:
    import sys

    runtime = sys.modules.get(RUNTIME)
    if runtime is None or getattr(fsdp, "_root_pre_forward", None) is None:
        return False
    if not _forces_full_precision_without_handle(runtime):
        return False
    if fsdp._root_pre_forward is not runtime._root_pre_forward:  # imported before the patch wrapped it
        patcher.wrap(fsdp, "_root_pre_forward", _root_pre_forward)
    return True
