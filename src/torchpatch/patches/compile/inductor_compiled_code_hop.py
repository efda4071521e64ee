"""inductor-compiled-code-hop: ``torch._higher_order_ops.inductor_compiled_code``, torch 2.4-2.9.

What breaks:   torchtitan 0.2.2 names the operator in the set of outputs its selective activation
               checkpointing saves (``models/*/infra/parallelize.py``, at module level), so on torch
               2.9 nothing trains: ``AttributeError: module 'torch._higher_order_ops' has no attribute
               'inductor_compiled_code'``.
Torch:         2.4-2.9; 2.10 added it, the operator through which Inductor's compiled code runs under
               a dispatch mode when ``wrap_inductor_compiled_regions`` is set.
Fix:           serve it (in ``torch._higher_order_ops`` and ``torch._higher_order_ops.wrap``): a
               higher-order operator of that name which autograd passes through and which, called
               on tensors, runs ``func(inputs)`` (``func.compiled_callable`` where ``func`` holds one),
               as torch 2.15's eager rule does. These torches never emit it: their Inductor does not
               wrap compiled code (inductor-wrap-compiled-regions says why that changes no value), so
               a policy that names it matches nothing, as on torch 2.15 without the key. Not served:
               its tracing rules (fake tensors, functionalization, proxy mode) and the side table of
               compiled callables.
Upstream:      https://github.com/pytorch/pytorch/pull/167844 (HOP for Inductor compiled regions)
"""

from typing import Any, Callable, List, Optional

from torchpatch import Patch

PATCH = Patch(
    id="inductor-compiled-code-hop",
    summary="torch._higher_order_ops.inductor_compiled_code (torch 2.10's operator of wrapped compiled regions)",
    torch=">=2.4,<2.10",
    upstream="https://github.com/pytorch/pytorch/pull/167844",
)

_served: List[Any] = []


def _operator() -> Any:
    if _served:
        return _served[0]
    from torch._C import DispatchKey
    from torch._ops import HigherOrderOperator

    class InductorCompiledCode(HigherOrderOperator):
        """Runs an Inductor compiled callable on its inputs, visible to dispatch modes."""

        def __init__(self) -> None:
            super().__init__("inductor_compiled_code")

        def __call__(self, func: Callable[..., Any], inputs: List[Any], *, name: Optional[str] = None) -> Any:
            return super().__call__(func, inputs, name=name)

    operator = InductorCompiledCode()
    operator.fallthrough(DispatchKey.AutogradCPU)
    operator.fallthrough(DispatchKey.AutogradCUDA)

    @operator.py_impl(DispatchKey.CompositeExplicitAutograd)
    def run(func: Callable[..., Any], inputs: List[Any], *, name: Optional[str] = None) -> Any:
        return getattr(func, "compiled_callable", func)(inputs)

    _served.append(operator)
    return operator


for _module in ("torch._higher_order_ops", "torch._higher_order_ops.wrap"):
    PATCH.symbol(_module, "inductor_compiled_code")(_operator)
