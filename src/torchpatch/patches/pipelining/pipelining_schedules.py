"""pipelining-schedules: ``get_schedule_class`` for torch 2.4's ``torch.distributed.pipelining``,
torch 2.4 and later.

What breaks:   torchtitan (early 2025) does
               ``from torch.distributed.pipelining.schedules import get_schedule_class`` at module
               load, so on torch 2.4 every one of its modules dies with ``ImportError: cannot
               import name 'get_schedule_class' from 'torch.distributed.pipelining.schedules'``.
Torch:         2.4 (the first release with ``torch.distributed.pipelining``; 2.5 added the
               function). Older torch has no pipelining package at all: nothing is served there.
Fix:           serve ``schedules.get_schedule_class(name)`` with upstream's semantics: the name is
               matched case-insensitively against the schedule names of the newest torch ("1F1B",
               "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble",
               "PipelineScheduleSingle", "PipelineScheduleMulti", "ZBVZeroBubble", "DualPipeV") and
               the schedule class of the installed torch is returned; an unknown name raises
               ``ValueError`` listing the valid names, as upstream does. A schedule that the
               installed torch does not have (on 2.4 ZBVZeroBubble, InterleavedZeroBubble and
               DualPipeV are served by ``pipelining-zbv``, ``pipelining-interleaved-zb`` and
               ``pipelining-dualpipev``, which also teach torch 2.5-2.8's own lookup theirs) raises
               ``ValueError`` saying which torch release brought it: that schedule cannot be run here.
Upstream:      https://github.com/pytorch/pytorch/pull/132768 (get_schedule_class, torch 2.5), made
               case-insensitive by https://github.com/pytorch/pytorch/pull/137103
"""

from types import ModuleType
from typing import Callable, Dict, Tuple

from torchpatch import Patch

PATCH = Patch(
    id="pipelining-schedules",
    summary="torch.distributed.pipelining.schedules.get_schedule_class (schedule class by name) "
    "where torch lacks it (2.4)",
    torch=">=2.4",
    upstream="https://github.com/pytorch/pytorch/pull/132768",
)

SCHEDULES = "torch.distributed.pipelining.schedules"

# Upstream's names, in upstream's order -> (class name in schedules, first torch release with it).
SCHEDULE_NAMES: Dict[str, Tuple[str, str]] = {
    "1F1B": ("Schedule1F1B", "2.4"),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", "2.4"),
    "GPipe": ("ScheduleGPipe", "2.4"),
    "LoopedBFS": ("ScheduleLoopedBFS", "2.4"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", "2.5"),
    "PipelineScheduleSingle": ("PipelineScheduleSingle", "2.4"),
    "PipelineScheduleMulti": ("PipelineScheduleMulti", "2.4"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", "2.6"),
    "DualPipeV": ("ScheduleDualPipeV", "2.9"),
}


def make_get_schedule_class(schedules: ModuleType, torch_version: str) -> Callable[[str], type]:
    """``get_schedule_class`` bound to a ``schedules`` module of the installed torch."""

    def get_schedule_class(schedule_name: str) -> type:
        """Maps a schedule name (case insensitive) to its corresponding class object.

        Args:
            schedule_name (str): The name of the schedule.
        """
        by_lower = {name.lower(): name for name in SCHEDULE_NAMES}
        name = by_lower.get(schedule_name.lower())
        if name is None:
            raise ValueError(
                f"Unknown schedule name '{schedule_name}'. The valid options are {list(SCHEDULE_NAMES)}"
            )
        class_name, since = SCHEDULE_NAMES[name]
        cls = getattr(schedules, class_name, None)
        if cls is None:
            here = [n for n, (c, _) in SCHEDULE_NAMES.items() if hasattr(schedules, c)]
            raise ValueError(
                f"Schedule '{schedule_name}' ({class_name}) needs torch >= {since}; the installed torch "
                f"{torch_version} does not have it. The schedules available here are {here}"
            )
        return cls

    return get_schedule_class


@PATCH.symbol(SCHEDULES, "get_schedule_class")
def serve_get_schedule_class() -> Callable[[str], type]:
    import torch
    import torch.distributed.pipelining.schedules as schedules

    return make_get_schedule_class(schedules, torch.__version__)
