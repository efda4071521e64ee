"""pipelining-return-outputs: ``schedule.step(..., return_outputs=False)`` on torch 2.4-2.9.

What breaks:   torchtitan 0.2.2 and 0.3.0 run every pipeline step as ``pp_schedule.step(inputs,
               target=targets, losses=losses, return_outputs=False)``; before the flag existed it is
               handed to the model as a keyword argument, and the first step dies with ``TypeError:
               Transformer.forward() got an unexpected keyword argument 'return_outputs'``.
Torch:         2.4-2.9 (2.13 has the flag; 2.10-2.12 are untested: where their ``step`` has it,
               nothing is changed).
Fix:           every schedule's ``step`` takes ``return_outputs`` (default True, as torch 2.15):
               True is this torch's call; False runs the same step and returns None instead of the
               last stage's merged outputs, as 2.15 does. The losses, gradients and the outputs kept
               by the stage for backward are this torch's; 2.15 also skips keeping the last stage's
               forward outputs (memory, not values), which is not done here.
Upstream:      https://github.com/pytorch/pytorch/tree/v2.13.0/torch/distributed/pipelining/schedules.py
               (``step(..., return_outputs=True)``)
"""

import inspect
from typing import Any, Dict, Tuple

from torchpatch import Error, Patch, Patcher

from .pipelining_presplit_inputs import schedules_with_step

PATCH = Patch(
    id="pipelining-return-outputs",
    summary="pipeline schedule step(..., return_outputs=False): the step without its merged outputs",
    torch=">=2.4,<2.10",
    upstream="https://github.com/pytorch/pytorch/tree/v2.13.0/torch/distributed/pipelining/schedules.py",
    behaviour="PipelineSchedule.step(return_outputs=...)",
    errors=(
        Error(r"kwargs: \{.*'return_outputs': ",
              "RuntimeError: [Stage 0] failed to run forward: args: ('Tensor(torch.Size([2, 6]), grad=False, dtype=torch.float64)',) kwargs: {'return_outputs': 'False'}"),
    ),
)


def _step(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    return_outputs = kwargs.pop("return_outputs", True)
    outputs = wrapped(*args, **kwargs)
    return outputs if return_outputs else None


@PATCH.on_import("torch.distributed.pipelining.schedules")
def step_takes_return_outputs(patcher: Patcher, schedules: Any) -> bool:
    if "return_outputs" in inspect.signature(schedules._PipelineSchedule.step).parameters:
        return False
    owners = schedules_with_step(schedules)
    for cls in owners:
        patcher.wrap(cls, "step", _step)
    return bool(owners)
