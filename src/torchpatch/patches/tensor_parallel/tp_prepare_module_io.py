"""tp-prepare-module-io: ``PrepareModuleInput`` and ``PrepareModuleOutput`` for torch 2.1's tensor parallel.

What breaks:   torchtitan (and the tensor-parallel tutorials since torch 2.2) plan a transformer block with
               ``from torch.distributed.tensor.parallel import PrepareModuleInput`` and die on torch 2.1
               with ``ImportError: cannot import name 'PrepareModuleInput' from
               'torch.distributed.tensor.parallel'`` (likewise ``PrepareModuleOutput``).
Torch:         2.1's ``parallelize_module`` knows only ColwiseParallel, RowwiseParallel and
               PairwiseParallel/SequenceParallel, built from ``_prepare_input``/``_prepare_output``
               functions; any other ParallelStyle falls into PairwiseParallel's path (an error for a
               module with several Linear children, silently nothing otherwise). The two styles came with
               torch 2.2 (pytorch#111166) and were reworked into the ``_apply(module, mesh)`` form that
               2.4 and later keep (pytorch#114732). 1.13 has no tensor parallel: nothing is served there.
Fix:           serve both classes on ``torch.distributed.tensor.parallel`` and its ``style`` module,
               subclasses of 2.1's ``ParallelStyle`` with the keyword arguments and semantics of torch
               >= 2.4 (checked against torch 2.13 by the tests):
               - ``PrepareModuleInput(input_layouts=, desired_input_layouts=, input_kwarg_layouts=,
                 desired_input_kwarg_layouts=, use_local_output=False)`` registers a forward pre-hook:
                 each positional input with a layout becomes a DTensor of that layout
                 (``DTensor.from_local``; a DTensor is taken as it is), is redistributed to the desired
                 layout when it differs, and is handed on as that DTensor or, with
                 ``use_local_output=True``, its local tensor (a plain tensor, the collective waited
                 for, as torch 2.4+ gives: 2.1's own ``to_local`` would return an
                 ``AsyncCollectiveTensor``); ``None`` layouts leave an input alone.
                 Keyword inputs likewise by name when ``input_kwarg_layouts`` is given.
               - ``PrepareModuleOutput(output_layouts=, desired_output_layouts=, use_local_output=True)``
                 registers a forward hook doing the same to the outputs (one output is returned bare,
                 several as a tuple).
               - ``parallelize_module`` (the function in ``parallel`` and ``parallel.api``, which the
                 dict form calls for each entry) is wrapped: for these two styles it runs torch's own
                 preamble (the TP RNG tracker) and applies the style on the 1-D mesh of
                 ``tp_mesh_dim`` as 2.1 does for its other styles; any other plan goes to torch
                 unchanged. Nothing of torch is replaced: the hook says "not needed" where ``style``
                 already has ``PrepareModuleInput``.
               2.1's own ColwiseParallel/RowwiseParallel keep their 2.1 arguments (``_prepare_input``,
               ``_prepare_output``; no ``input_layouts``); their defaults match newer torch's
               (replicated input and sharded local output for Colwise, sharded input and replicated
               local output for Rowwise), so a plan combining them with these styles computes as it
               does on torch 2.4+.
Upstream:      https://github.com/pytorch/pytorch/pull/111166 (the two styles, torch 2.2), rewritten by
               https://github.com/pytorch/pytorch/pull/114732
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Callable, Dict, Optional, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="tp-prepare-module-io",
    summary="torch.distributed.tensor.parallel.PrepareModuleInput and PrepareModuleOutput (torch >= 2.4 "
    "semantics) applied by torch 2.1's parallelize_module",
    torch=">=2.1,<2.2",
    upstream="https://github.com/pytorch/pytorch/pull/114732",
    behaviour="parallelize_module applies PrepareModuleInput/PrepareModuleOutput plans",
)

PACKAGE = "torch.distributed.tensor.parallel"
STYLE = "torch.distributed.tensor.parallel.style"
NAMES = ("PrepareModuleInput", "PrepareModuleOutput")


def _as_tuple(layouts: Any, placement: type) -> Optional[Tuple[Any, ...]]:
    return (layouts,) if isinstance(layouts, placement) else (None if layouts is None else tuple(layouts))


def _prepare(value: Any, mesh: Any, layout: Any, desired: Any, use_local: bool) -> Any:
    """``value`` as a DTensor of ``layout`` (a DTensor is taken as it is), then of ``desired``."""
    import torch
    from torch.distributed._tensor import DTensor

    if layout is None:
        return value
    if not isinstance(value, DTensor):
        if not isinstance(value, torch.Tensor):
            raise AssertionError("expecting input to be a torch.Tensor!")
        value = DTensor.from_local(value, mesh, (layout,), run_check=False)
    if desired is not None and desired != layout:
        value = value.redistribute(value.device_mesh, (desired,))
    if use_local:  # to_local, waited: 2.1's would hand on an AsyncCollectiveTensor where 2.4+ has waited
        from torchpatch.patches.dtensor.dtensor_public import _to_local_waited

        return _to_local_waited().apply(value, None)
    return value


@functools.lru_cache(maxsize=None)
def styles() -> Tuple[type, type]:
    """(PrepareModuleInput, PrepareModuleOutput), subclasses of this torch's ParallelStyle."""
    import torch.nn as nn
    from torch.distributed._tensor.placement_types import Placement
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class PrepareModuleInput(ParallelStyle):
        """Turn a module's input tensors into DTensors of ``input_layouts``, redistributed to
        ``desired_input_layouts`` (torch >= 2.4's ``PrepareModuleInput``, served by torchpatch)."""

        def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                     input_kwarg_layouts: Optional[Dict[str, Any]] = None,
                     desired_input_kwarg_layouts: Optional[Dict[str, Any]] = None,
                     use_local_output: bool = False) -> None:
            self.input_layouts = _as_tuple(input_layouts, Placement)
            self.desired_input_layouts = _as_tuple(desired_input_layouts, Placement)
            self.use_local_output = use_local_output
            if self.input_layouts is not None:
                if self.desired_input_layouts is None:
                    raise AssertionError("desired module inputs should not be None!")
                if len(self.input_layouts) != len(self.desired_input_layouts):
                    raise AssertionError("input_layouts and desired_input_layouts should have same length!")
            self.with_kwargs = input_kwarg_layouts is not None
            self.input_kwarg_layouts = input_kwarg_layouts or {}
            self.desired_input_kwarg_layouts = desired_input_kwarg_layouts or {}
            if self.with_kwargs and len(self.input_kwarg_layouts) != len(self.desired_input_kwarg_layouts):
                raise AssertionError("input_kwarg_layouts and desired_input_kwarg_layouts should have same length!")

        def _prepare_input_fn(self, inputs: Any, device_mesh: Any) -> Any:
            if self.input_layouts is None:
                return inputs
            if not isinstance(inputs, tuple):
                inputs = (inputs,)
            if len(inputs) != len(self.input_layouts):
                raise ValueError("module inputs and input_layouts should have same length!")
            return tuple(_prepare(value, device_mesh, layout, desired, self.use_local_output)
                         for value, layout, desired in zip(inputs, self.input_layouts, self.desired_input_layouts))

        def _prepare_input_kwarg_fn(self, inputs: Any, kwargs: Dict[str, Any], device_mesh: Any) -> Any:
            prepared = {key: _prepare(value, device_mesh, self.input_kwarg_layouts.get(key),
                                      self.desired_input_kwarg_layouts.get(key), self.use_local_output)
                        for key, value in kwargs.items()}
            return self._prepare_input_fn(inputs, device_mesh), prepared

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            if self.with_kwargs:
                module.register_forward_pre_hook(
                    lambda _, inputs, kwargs: self._prepare_input_kwarg_fn(inputs, kwargs, device_mesh),
                    with_kwargs=True)
            else:
                module.register_forward_pre_hook(lambda _, inputs: self._prepare_input_fn(inputs, device_mesh))
            return module

        def __repr__(self) -> str:
            return (f"{type(self).__name__}(input_layouts={self.input_layouts}, "
                    f"desired_input_layouts={self.desired_input_layouts}, "
                    f"input_kwarg_layouts={self.input_kwarg_layouts}, "
                    f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, "
                    f"use_local_output={self.use_local_output})")

    class PrepareModuleOutput(ParallelStyle):
        """Turn a module's output tensors into DTensors of ``output_layouts``, redistributed to
        ``desired_output_layouts`` (torch >= 2.4's ``PrepareModuleOutput``, served by torchpatch)."""

        def __init__(self, *, output_layouts: Any, desired_output_layouts: Any, use_local_output: bool = True) -> None:
            self.output_layouts = _as_tuple(output_layouts, Placement)
            self.desired_output_layouts = _as_tuple(desired_output_layouts, Placement)
            self.use_local_output = use_local_output
            if len(self.output_layouts) != len(self.desired_output_layouts):
                raise AssertionError("output_layouts and desired_output_layouts should have same length!")

        def _prepare_out_fn(self, outputs: Any, device_mesh: Any) -> Any:
            if not isinstance(outputs, tuple):
                outputs = (outputs,)
            if len(outputs) != len(self.output_layouts):
                raise ValueError("module outputs and output_layouts should have same length!")
            prepared = tuple(_prepare(value, device_mesh, layout, desired, self.use_local_output)
                             for value, layout, desired in zip(outputs, self.output_layouts, self.desired_output_layouts))
            return prepared[0] if len(prepared) == 1 else prepared

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            module.register_forward_hook(lambda _, inputs, outputs: self._prepare_out_fn(outputs, device_mesh))
            return module

        def __repr__(self) -> str:
            return (f"{type(self).__name__}(output_layouts={self.output_layouts}, "
                    f"desired_output_layouts={self.desired_output_layouts}, "
                    f"use_local_output={self.use_local_output})")

    return PrepareModuleInput, PrepareModuleOutput


def _serve(index: int) -> Callable[[], type]:
    return lambda: styles()[index]


for _module in (PACKAGE, STYLE):
    for _index, _name in enumerate(NAMES):
        PATCH.symbol(_module, _name)(_serve(_index))


def _plan_args(module: Any, device_mesh: Any, parallelize_plan: Any, tp_mesh_dim: int = 0) -> Tuple[Any, Any, Any, int]:
    return module, device_mesh, parallelize_plan, tp_mesh_dim


def _parallelize_module(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    module, device_mesh, plan, tp_mesh_dim = _plan_args(*args, **kwargs)
    if not isinstance(plan, styles()):
        return wrapped(*args, **kwargs)
    from torch.distributed.tensor.parallel._utils import _create_1d_device_mesh

    wrapped(module, device_mesh, {}, tp_mesh_dim)  # torch's preamble (TP RNG tracker); an empty plan does nothing else
    return plan._apply(module, _create_1d_device_mesh(device_mesh, tp_mesh_dim))


@PATCH.on_import(PACKAGE)
def apply_prepare_styles(patcher: Patcher, package: ModuleType) -> bool:
    import torch.distributed.tensor.parallel.api as api
    import torch.distributed.tensor.parallel.style as style

    if "PrepareModuleInput" in vars(style):
        return False
    patcher.wrap(api, "parallelize_module", _parallelize_module)
    patcher.wrap(package, "parallelize_module", _parallelize_module)
    return True
