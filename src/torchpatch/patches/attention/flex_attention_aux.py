"""flex-attention-aux: FlexAttention's ``AuxRequest``, ``AuxOutput`` and ``FlexKernelOptions``, and
``flex_attention(..., return_aux=...)``, on torch 2.5-2.8.

What breaks:   code written for torch 2.9+ dies on 2.5-2.8 with ``ImportError: cannot import name
               'AuxRequest' from 'torch.nn.attention.flex_attention'`` (likewise ``AuxOutput``,
               ``FlexKernelOptions``), and ``flex_attention(q, k, v, return_aux=AuxRequest(lse=True))``
               with ``TypeError: flex_attention() got an unexpected keyword argument 'return_aux'``.
Torch:         2.5-2.8's flex_attention returns the logsumexp with ``return_lse=True`` (2.9 deprecated
               it for ``return_aux``) and takes ``kernel_options`` as a plain dict; its kernels
               do not compute the row maxima (``max_scores``, 2.9).
Fix:           serve the three types as torch 2.15 defines them (two NamedTuples, a TypedDict of the
               documented options), and give ``flex_attention`` the keyword-only ``return_aux``:
               ``None`` calls torch's own function unchanged; ``AuxRequest(lse=...)`` returns
               ``(out, AuxOutput(lse=lse or None))`` through torch's ``return_lse``; with
               ``return_lse=True`` too it raises 2.15's ``ValueError``; ``max_scores=True`` raises
               2.15's ``NotImplementedError`` on CPU and, elsewhere, one saying that this torch's
               kernels lack the row maxima. The wrapper is a plain function, so torch.compile traces
               through it into torch's own.
Upstream:      https://github.com/pytorch/pytorch/pull/161667 (return_aux, torch 2.9)
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import Any, Callable, Dict, NamedTuple, Optional

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="flex-attention-aux",
    summary="torch.nn.attention.flex_attention's AuxRequest, AuxOutput, FlexKernelOptions and "
            "flex_attention(return_aux=...)",
    torch=">=2.5,<2.9",
    upstream="https://github.com/pytorch/pytorch/pull/161667",
    behaviour="flex_attention(..., return_aux=AuxRequest(...))",
)

_MODULE = "torch.nn.attention.flex_attention"


class AuxRequest(NamedTuple):
    """Which auxiliary outputs flex_attention computes besides the attention output."""

    lse: bool = False
    max_scores: bool = False


class AuxOutput(NamedTuple):
    """flex_attention's auxiliary outputs: each the requested tensor, or None."""

    lse: Optional[Any] = None
    max_scores: Optional[Any] = None


def _kernel_options() -> type:
    """torch 2.15's documented FlexAttention kernel options, as a TypedDict (all optional)."""
    from typing_extensions import Literal, TypedDict

    fields: Dict[str, Any] = {name: int for name in (
        "num_warps", "num_stages", "BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2",
        "kpack", "matrix_instr_nonkdim", "waves_per_eu")}
    fields.update({name: bool for name in (
        "PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "WRITE_DQ", "FORCE_USE_FLEX_ATTENTION",
        "USE_TMA")})
    fields["BACKEND"] = Literal["AUTO", "TRITON", "FLASH", "TRITON_DECODE"]
    options = TypedDict("FlexKernelOptions", fields, total=False)
    options.__doc__ = ("Options for FlexAttention's kernels (``kernel_options``); a ``fwd_``/``bwd_`` prefix "
                       "applies one to the forward or backward pass only.")
    return options


def _with_return_aux(flex_attention: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(flex_attention)
    def wrapper(query: Any, key: Any, value: Any, score_mod: Any = None, block_mask: Any = None,
                scale: Optional[float] = None, enable_gqa: bool = False, return_lse: bool = False,
                kernel_options: Optional[Dict[str, Any]] = None, *, return_aux: Optional[AuxRequest] = None) -> Any:
        if return_aux is None:
            return flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                  kernel_options)
        if return_lse:
            raise ValueError("Cannot specify both return_lse and return_aux. return_lse is deprecated, please "
                             "use return_aux=AuxRequest(lse=True) instead.")
        if return_aux.max_scores:
            if "cpu" in (query.device.type, key.device.type, value.device.type):
                raise NotImplementedError("Returning max scores is not supported on CPU.")
            import torch

            raise NotImplementedError(
                f"flex_attention(return_aux=AuxRequest(max_scores=True)) needs torch >= 2.9: the FlexAttention "
                f"kernels of torch {torch.__version__} do not compute the row maxima")
        result = flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, bool(return_aux.lse),
                                kernel_options)
        return (result[0], AuxOutput(lse=result[1])) if return_aux.lse else (result, AuxOutput())

    wrapper.__signature__ = inspect.signature(wrapper, follow_wrapped=False)  # its own: with return_aux
    return wrapper


for _type in (AuxRequest, AuxOutput):
    _type.__module__ = _MODULE
    PATCH.symbol(_MODULE, _type.__name__)(lambda t=_type: t)


@PATCH.symbol(_MODULE, "FlexKernelOptions")
def _flex_kernel_options() -> type:
    options = _kernel_options()
    options.__module__ = _MODULE
    return options


@PATCH.on_import(_MODULE)
def _add_return_aux(patcher: Patcher, module: ModuleType) -> bool:
    if "return_aux" in inspect.signature(module.flex_attention).parameters:
        return False
    patcher.setattr(module, "flex_attention", _with_return_aux(module.flex_attention))
    return True
