"""dtensor-context-parallel-210: the names of torch 2.10's context-parallel API that code imports at
module level (``_context_parallel_shard``, ``_enable_context_parallel_dispatcher``,
``_HeadTailLoadBalancer``, ``_PTRRLoadBalancer``, ``_ContextParallel``,
``_context_parallel._attention.flex_cp_allgather``) on torch 2.4-2.9, raising a clear error when used.

What breaks:   torchtitan 0.3.0 imports them at module level in the module every model's
               ``parallelize`` imports (``torchtitan/distributed/context_parallel/api.py``), so on torch
               2.9 nothing trains, context parallel or not: ``ImportError: cannot import name
               '_context_parallel_shard' from 'torch.distributed.tensor.experimental._attention'``;
               torchtitan 0.2.2 imports them and ``_ContextParallel`` in
               ``torchtitan/distributed/context_parallel.py``, which every model's ``parallelize`` imports.
Torch:         2.10 moved context parallel into the package
               ``torch.distributed.tensor.experimental._context_parallel`` (re-exported by ``_attention``)
               with load balancers as objects, a buffer-sharding function that takes one, a global
               switch of the DTensor SDPA dispatcher, the attention-module parallel style
               ``_ContextParallel`` (with its ``AttentionType`` enum) and a flex-attention all-gather
               custom op; 2.9 has
               the older single-module ring attention (``_context_parallel``, ``context_parallel``, its
               own round-robin indices) and none of these names.
Fix:           serve the names so that modules importing them load; each raises ``NotImplementedError``
               when called or constructed, saying that torch 2.10's context parallel is not served on this
               torch (its load balancers and sharding are not backported; context_parallel_degree=1
               training never calls them). ``_ContextParallel`` is a ``ParallelStyle`` whose
               ``AttentionType`` (``FLEX``, ``SDPA``) is 2.15's, so plans can name it; constructing it
               raises. Not served: the rest of torch 2.10's package.
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/tensor/experimental/_context_parallel
"""

import enum
from types import ModuleType
from typing import Any, Callable, NoReturn

from torchpatch import Patch

PATCH = Patch(
    id="dtensor-context-parallel-210",
    summary="torch 2.10's context-parallel names imported at module level (_context_parallel_shard, "
    "load balancers, _ContextParallel, flex_cp_allgather) on torch 2.9: they load and raise NotImplementedError when used",
    torch=">=2.4,<2.10",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/tensor/experimental/_context_parallel",
)

ATTENTION = "torch.distributed.tensor.experimental._attention"
PACKAGE = "torch.distributed.tensor.experimental._context_parallel"


def _unserved(name: str) -> NoReturn:
    raise NotImplementedError(
        f"{name} is torch 2.10's context parallel, which torchpatch does not serve on this torch: its load "
        "balancers, buffer sharding and dispatcher switch are not backported; train with "
        "context_parallel_degree=1 or use torch >= 2.10")


def _function(name: str) -> Callable[..., NoReturn]:
    def unserved(*args: Any, **kwargs: Any) -> NoReturn:
        _unserved(name)

    unserved.__name__ = unserved.__qualname__ = name
    return unserved


def _class(name: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _unserved(name)

    return type(name, (), {"__init__": __init__, "__module__": ATTENTION})


def _context_parallel_style() -> type:
    """``_ContextParallel``: a ``ParallelStyle`` with 2.15's ``AttentionType``; constructing it raises."""
    from torch.distributed.tensor.parallel import ParallelStyle

    attention_type = enum.Enum("AttentionType", {"FLEX": "flex_attention", "SDPA": "scaled_dot_product_attention"})
    attention_type.__module__, attention_type.__qualname__ = ATTENTION, "_ContextParallel.AttentionType"
    unserved = _function("_ContextParallel")
    return type("_ContextParallel", (ParallelStyle,), {
        "__init__": unserved, "_apply": unserved, "__module__": ATTENTION, "AttentionType": attention_type})


_FUNCTIONS = ("_context_parallel_shard", "_enable_context_parallel_dispatcher")
_CLASSES = ("_HeadTailLoadBalancer", "_PTRRLoadBalancer")
for _name in _FUNCTIONS:
    PATCH.symbol(ATTENTION, _name)(lambda _name=_name: _function(_name))
for _name in _CLASSES:
    PATCH.symbol(ATTENTION, _name)(lambda _name=_name: _class(_name))

PATCH.symbol(ATTENTION, "_ContextParallel")(_context_parallel_style)

PATCH.sets(f"{PACKAGE}._attention", ("flex_cp_allgather",))


@PATCH.module(ATTENTION)
def build_attention_module(module: ModuleType) -> None:
    """torch 2.4 (no ``_attention`` module): the names above, each raising when used."""
    for name in _FUNCTIONS:
        setattr(module, name, _function(name))
    for name in _CLASSES:
        setattr(module, name, _class(name))
    module._ContextParallel = _context_parallel_style()


@PATCH.module(PACKAGE)
def build_package(module: ModuleType) -> None:
    """The package: only its ``_attention`` submodule is served."""


@PATCH.module(f"{PACKAGE}._attention")
def build_attention(module: ModuleType) -> None:
    module.flex_cp_allgather = _function("flex_cp_allgather")
