"""pipelining: ``torch.distributed.pipelining`` (manual stages and the GPipe, 1F1B, Interleaved
1F1B and Looped BFS schedules), a real pipeline runtime, torch 2.1-2.3.

What breaks:   torchtitan (mid 2024 and later) imports the package at module load:
               ``from torch.distributed.pipelining import PipelineStage`` and
               ``from torch.distributed.pipelining.schedules import ScheduleGPipe, ...`` die with
               ``ModuleNotFoundError: No module named 'torch.distributed.pipelining'``.
Torch:         2.1–2.3 (2.4 brought the package; ``get_schedule_class`` came with 2.5, for 2.4 the
               ``pipelining-schedules`` patch serves it). Nothing is served from 2.4 on.
Fix:           serve the package and its submodules ``schedules``, ``stage`` and ``microbatch``,
               backed by :mod:`torchpatch.patches.pipelining._runtime`:
               - ``PipelineStage(submodule, stage_index, num_stages, device, input_args=None,
                 output_args=None, group=None)``: stage ``i`` on rank ``i % group size``; shapes are
                 learnt at the first step (the first activation carries them) and checked against
                 ``input_args``/``output_args`` where given.
               - ``ScheduleGPipe``, ``Schedule1F1B`` (one stage per rank), ``ScheduleInterleaved1F1B``
                 and ``ScheduleLoopedBFS`` (several), their bases ``PipelineScheduleSingle`` /
                 ``PipelineScheduleMulti``, with torch's ``step(*args, target=..., losses=[...],
                 return_outputs=True, loss_kwargs=None, **kwargs)`` and ``eval``: the first stage's
                 rank passes the batch, the last stage's the target; microbatches split along
                 dimension 0 (``TensorChunkSpec``, ``args_chunk_spec``/``kwargs_chunk_spec``),
                 outputs merged (``output_merge_spec``), one loss per microbatch, and the
                 ``scale_grads`` argument of torch >= 2.7 with its default, True (gradients of the
                 mean of the microbatch losses; False gives torch 2.4's sum). Point-to-point
                 messages go through ``batch_isend_irecv`` on the pipeline group (gloo or NCCL),
                 ordered alike on both ends of every pair of ranks.
               - ``schedules.get_schedule_class`` by name, as the ``pipelining-schedules`` patch
                 serves it on 2.4 (the zero-bubble and DualPipeV schedules name the torch that
                 has them).
               - An exception in one stage raises on its rank, naming the stage and microbatch;
                 the other ranks' waits then fail (the peer's connection closes, or the process
                 group's timeout runs out) with an error naming what they waited for.
               Not served: ``pipeline()``, ``pipe_split()``, ``SplitPoint``'s members,
               ``build_stage()`` and ``Pipe`` (tracer-based splitting, torch 2.4's torch.export)
               raise ``NotImplementedError`` saying so and pointing to manual ``PipelineStage``;
               the zero-bubble schedules and the CSV-driven ``_PipelineScheduleRuntime`` are not
               served; a DistributedDataParallel-wrapped stage module raises.
Upstream:      https://github.com/pytorch/pytorch/pull/124776 (torch.distributed.pipelining, torch 2.4);
               https://github.com/pytorch/pytorch/pull/144352 (scale_grads)
"""

import importlib
from types import ModuleType

from torchpatch import Patch

PATCH = Patch(
    id="pipelining",
    summary="torch.distributed.pipelining (PipelineStage, GPipe/1F1B/Interleaved1F1B/LoopedBFS schedules, "
    "microbatching)",
    torch=">=2.1,<2.4",
    upstream="https://github.com/pytorch/pytorch/pull/124776",
)

PACKAGE = "torch.distributed.pipelining"
# name in the served module -> name in the runtime, per module.
MICROBATCH = ("TensorChunkSpec", "split_args_kwargs_into_chunks", "merge_chunks", "_Replicate",
              "_CustomReducer", "_LossReducer", "sum_reducer", "DEFAULT_CHUNK_DIM")
STAGE = ("PipelineStage", "build_stage")
SCHEDULES = ("_PipelineSchedule", "PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe",
             "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS")
TOP = ("Pipe", "pipe_split", "SplitPoint", "pipeline", "PipelineStage", "build_stage", "Schedule1F1B",
       "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS")


def _fill(module: ModuleType, names: tuple) -> None:
    from torchpatch.patches.pipelining import _runtime as runtime

    for name in names:
        setattr(module, name, getattr(runtime, name))
    module.__all__ = [n for n in names if not n.startswith("_") and n != "DEFAULT_CHUNK_DIM"]


PATCH.sets(PACKAGE, TOP)
PATCH.sets(f"{PACKAGE}.microbatch", MICROBATCH)
PATCH.sets(f"{PACKAGE}.stage", STAGE)
PATCH.sets(f"{PACKAGE}.schedules", SCHEDULES + ("get_schedule_class",))


@PATCH.module(PACKAGE)
def build_package(module: ModuleType) -> None:
    _fill(module, TOP)
    for sub in ("microbatch", "stage", "schedules"):  # attributes of the package, as in torch
        importlib.import_module(f"{PACKAGE}.{sub}")


@PATCH.module(f"{PACKAGE}.microbatch")
def build_microbatch(module: ModuleType) -> None:
    _fill(module, MICROBATCH)


@PATCH.module(f"{PACKAGE}.stage")
def build_stage(module: ModuleType) -> None:
    _fill(module, STAGE)


@PATCH.module(f"{PACKAGE}.schedules")
def build_schedules(module: ModuleType) -> None:
    import torch

    from torchpatch.patches.pipelining.pipelining_schedules import make_get_schedule_class

    _fill(module, SCHEDULES)
    module.get_schedule_class = make_get_schedule_class(module, torch.__version__)
    module.__all__.append("get_schedule_class")
