"""tp-prepare-module-input-output: ``PrepareModuleInputOutput`` on torch 2.4-2.7.

What breaks:   tensor-parallel plans written for torch >= 2.8 (torchtitan's Llama 4 and MoE
               models, imported by ``import torchtitan`` in 0.1.0) do
               ``from torch.distributed.tensor.parallel import PrepareModuleInputOutput`` and die
               with ``ImportError: cannot import name 'PrepareModuleInputOutput' from
               'torch.distributed.tensor.parallel'``.
Torch:         2.2-2.7 have ``PrepareModuleInput`` and ``PrepareModuleOutput`` but not the style that
               applies both to one module (``parallelize_module``'s dict plan allows one style per
               module); it came with 2.8.
Fix:           serve the class on ``torch.distributed.tensor.parallel`` and its ``style`` module with
               torch 2.8's keyword-only arguments and semantics: a ``ParallelStyle`` holding a
               ``PrepareModuleInput`` (``use_local_input`` is its ``use_local_output``) and a
               ``PrepareModuleOutput`` of this torch, and applying both, input first. Tested on
               2.4 (the matrix's torch in this range) against the two styles applied one after
               the other, and against torch >= 2.8's own class.
Upstream:      https://github.com/pytorch/pytorch/pull/150372 (torch 2.8)
"""

from typing import Any, Dict, Optional

from torchpatch import Patch

PATCH = Patch(
    id="tp-prepare-module-input-output",
    summary="torch.distributed.tensor.parallel.PrepareModuleInputOutput",
    torch=">=2.4,<2.8",
    upstream="https://github.com/pytorch/pytorch/pull/150372",
)


def _make_class() -> Any:
    from torch.distributed.tensor.parallel.style import ParallelStyle, PrepareModuleInput, PrepareModuleOutput

    class PrepareModuleInputOutput(ParallelStyle):
        """Prepare a module's inputs as ``PrepareModuleInput`` and its outputs as
        ``PrepareModuleOutput`` (torch >= 2.8's style, served by torchpatch)."""

        def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                     input_kwarg_layouts: Optional[Dict[str, Any]] = None,
                     desired_input_kwarg_layouts: Optional[Dict[str, Any]] = None,
                     use_local_input: bool = False, output_layouts: Any, desired_output_layouts: Any,
                     use_local_output: bool = True) -> None:
            self.prepare_module_input = PrepareModuleInput(
                input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
                input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
                use_local_output=use_local_input)
            self.prepare_module_output = PrepareModuleOutput(
                output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
                use_local_output=use_local_output)

        def _apply(self, module: Any, device_mesh: Any) -> Any:
            self.prepare_module_input._apply(module, device_mesh)
            self.prepare_module_output._apply(module, device_mesh)
            return module

        def __repr__(self) -> str:
            i, o = self.prepare_module_input, self.prepare_module_output
            return (f"{type(self).__name__}(input_layouts={i.input_layouts}, desired_input_layouts="
                    f"{i.desired_input_layouts}, input_kwarg_layouts={i.input_kwarg_layouts}, "
                    f"desired_input_kwarg_layouts={i.desired_input_kwarg_layouts}, use_local_input="
                    f"{i.use_local_output}, output_layouts={o.output_layouts}, desired_output_layouts="
                    f"{o.desired_output_layouts}, use_local_output={o.use_local_output})")

    PrepareModuleInputOutput.__module__ = "torch.distributed.tensor.parallel.style"
    return PrepareModuleInputOutput


_CLASS: list = []


def _served() -> Any:
    """One class for both modules (``parallel`` re-exports ``style``'s)."""
    if not _CLASS:
        _CLASS.append(_make_class())
    return _CLASS[0]


PATCH.symbol("torch.distributed.tensor.parallel.style", "PrepareModuleInputOutput")(_served)
PATCH.symbol("torch.distributed.tensor.parallel", "PrepareModuleInputOutput")(_served)
