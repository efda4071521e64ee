"""The pipeline runtime behind the ``pipelining`` patch: ``torch.distributed.pipelining`` (manual
stages, GPipe / 1F1B / Interleaved 1F1B / Looped BFS schedules, microbatch split and merge) for a
torch that lacks it. Not a patch (the leading underscore): it imports torch, and is imported only
when the served package is, or directly (``benchmarks/pipelining.py`` runs it on a newer torch).
Its layers, one module each: ``microbatch``, ``stage``, ``timeline``, ``schedules``; this package
serves what the ``pipelining`` patch takes from them.

How a step runs. Every schedule is, per rank, an ordered list of compute actions (forward ``F`` or
full backward ``B`` of one stage on one microbatch). All ranks derive the same global timeline from
those lists: each action is placed at the first time step after its inputs were produced (an
activation from the previous stage, a gradient from the next). A message produced at step ``t``
is sent, and posted for receipt on its destination rank, in that rank's batch for step ``t``
(``batch_isend_irecv``), so every pair of ranks issues its point-to-point operations in the same
order on both sides (what NCCL needs; gloo also gets one tag per stage and direction). A rank only
blocks where a compute action needs a message that has not arrived. Shapes are learnt at the first
step: the first activation a stage sends carries its tensor metadata, from which the next stage
sizes its receive buffers (one per microbatch, reused at every step, as in torch).
"""

from types import FunctionType

from .microbatch import (DEFAULT_CHUNK_DIM, TensorChunkSpec, _CustomReducer, _LossReducer, _Replicate, merge_chunks,
                         split_args_kwargs_into_chunks, sum_reducer)
from .schedules import (PipelineScheduleMulti, PipelineScheduleSingle, Schedule1F1B, ScheduleGPipe,
                        ScheduleInterleaved1F1B, ScheduleLoopedBFS, _PipelineSchedule)
from .stage import Pipe, PipelineStage, SplitPoint, build_stage, pipe_split, pipeline

__all__ = ["DEFAULT_CHUNK_DIM", "TensorChunkSpec", "_CustomReducer", "_LossReducer", "_Replicate", "merge_chunks",
           "split_args_kwargs_into_chunks", "sum_reducer", "PipelineScheduleMulti", "PipelineScheduleSingle",
           "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "_PipelineSchedule",
           "Pipe", "PipelineStage", "SplitPoint", "build_stage", "pipe_split", "pipeline"]

# The classes and functions served here go by the package's name (in reprs, TensorChunkSpec's among
# them, and to pickle), not by the name of the module that defines them.
for _name in __all__:
    if isinstance(globals()[_name], (type, FunctionType)):
        globals()[_name].__module__ = __name__
del _name
