"""dtensor-spec-aliasing: ``dt[:, i]`` on a DTensor not sharded on that dim changes ``dt``'s own
shape, torch 2.8-2.9.

What breaks:   sharding propagation writes each output's shape into the output's ``DTensorSpec`` in
               place, and a strategy may hand back its input's spec object as the output's
               (2.8's ``select_int_strategy`` does whenever the input is not sharded on the
               selected dim). The input DTensor then carries the output's shape: after
               ``w[:, 16]`` on a replicated ``(1, 18, 16, 256)`` DTensor, ``w.shape`` is
               ``(1, 16, 256)``, the next ``w[:, 17]`` says ``(1, 256)`` while its local tensor is
               ``(1, 16, 256)``, and a reshape of it fails ("shape '[16, 256]' is invalid for input
               of size 65536"; torchtitan 0.3's state-dict hook that splits the fused ``wqkv``
               weight into ``wq``/``wk``/``wv``), or later ops compute with a wrong global shape.
Torch:         2.8 (``select_int_strategy``) and 2.9 (reproduced on 2.9.0); torch 2.10 builds each
               output spec as a new object (``_create_output_spec_with_new_tensor_meta``), so no
               input spec changes (2.13.0, 2.14.1, 2.15.0 checked).
Fix:           each op's strategy propagation starts from copies of its inputs' specs (the
               strategies ``_wrap_with_op_strategy`` builds hold shallow copies), so what the
               strategy returns and torch then fills in is never a DTensor's own spec. Applied
               where ``ShardingPropagator`` lacks ``_create_output_spec_with_new_tensor_meta``.
Upstream:      https://github.com/pytorch/pytorch/pull/162702 (torch 2.10; the select case:
               https://github.com/pytorch/pytorch/issues/179290)
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Dict, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="dtensor-spec-aliasing",
    summary="DTensor sharding propagation no longer writes an op's output shape into its input's spec "
            "(dt[:, i] changed dt's shape)",
    torch=">=2.8,<2.10",
    upstream="https://github.com/pytorch/pytorch/pull/162702",
    behaviour="indexing (select) a DTensor that is not sharded on the indexed dim",
    category="correctness",
)


def _own_copies(strategy: Any) -> None:
    """Give each input strategy its own copy of the input's spec."""
    children = getattr(strategy, "children", None)
    if children is not None:  # TupleStrategy: a list of tensors
        for child in children:
            _own_copies(child)
        return
    for op_spec in getattr(strategy, "strategies", ()):
        spec = op_spec.output_specs
        if hasattr(spec, "shallow_copy_with_tensor_meta"):
            op_spec.output_specs = spec.shallow_copy_with_tensor_meta(spec.tensor_meta)


def _wrap_with_op_strategy(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    schema = wrapped(*args, **kwargs)
    for arg in (*schema.args_schema, *schema.kwargs_schema.values()):
        _own_copies(arg)
    return schema


@PATCH.on_import("torch.distributed.tensor._sharding_prop")
def _patch(patcher: Patcher, module: ModuleType) -> bool:
    propagator = module.ShardingPropagator
    if hasattr(propagator, "_create_output_spec_with_new_tensor_meta"):
        return False  # torch >= 2.10 fills new output specs
    patcher.wrap(propagator, "_wrap_with_op_strategy", _wrap_with_op_strategy)
    return True
