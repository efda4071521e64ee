"""pipelining-stage-info: ``torch.distributed.pipelining.stage.PipelineStageInfo``, torch 2.4-2.14.

What breaks:   code written for torch 2.15 that names the identity of a stage's forward call, e.g.
               ``from torch.distributed.pipelining import PipelineStageInfo`` for the type of its
               forward-context factories, dies with ``ImportError: cannot import name
               'PipelineStageInfo'``.
Torch:         2.4-2.14 have ``torch.distributed.pipelining`` without it; 2.15 added it.
Fix:           serve it in ``stage`` and in the package: 2.15's immutable value, a frozen dataclass with
               keyword-only fields ``stage_index``, ``microbatch_index`` and ``is_metadata_inference``
               (default False), equal and hashable by value. On Python 3.8 and 3.9, which lack
               dataclasses' ``kw_only`` and ``slots``, the fields may also be passed positionally and
               instances have a ``__dict__``. Not served: ``PipelineStage.register_forward_context``,
               the 2.15 method that hands these values to a factory.
Upstream:      torch 2.15 (``PipelineStageInfo``), see
               https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/pipelining/stage.py
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from torchpatch import Patch

PATCH = Patch(
    id="pipelining-stage-info",
    summary="torch.distributed.pipelining.stage.PipelineStageInfo (identity of a stage's forward call)",
    torch=">=2.4,<2.15",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/pipelining/stage.py",
)

STAGE = "torch.distributed.pipelining.stage"
_KEYWORD_ONLY = {"kw_only": True, "slots": True} if sys.version_info >= (3, 10) else {}


@dataclass(frozen=True, **_KEYWORD_ONLY)
class PipelineStageInfo:
    """Identify one pipeline-stage forward invocation: the global ``stage_index``, the
    ``microbatch_index`` within the step, and whether it is the dynamic metadata-inference probe
    (``is_metadata_inference``) rather than real execution. Owns no tensors or state."""

    stage_index: int
    microbatch_index: int
    is_metadata_inference: bool = False


@PATCH.symbol(STAGE, "PipelineStageInfo")
def serve_stage_info() -> type:
    PipelineStageInfo.__module__ = STAGE
    return PipelineStageInfo


@PATCH.symbol("torch.distributed.pipelining", "PipelineStageInfo")
def serve_in_package() -> Any:
    import torch.distributed.pipelining.stage as stage

    return stage.PipelineStageInfo
