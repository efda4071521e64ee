"""pipelining-dualpipev-overlap: ``torch.distributed.pipelining.schedules.OVERLAP_F_B`` and
``_wait_batch_p2p``, the names of torch 2.9's overlapped DualPipeV actions, on torch 2.4-2.8.

What breaks:   torchtitan 0.2.2 does ``from torch.distributed.pipelining.schedules import OVERLAP_F_B`` in
               ``torchtitan/distributed/pipeline_parallel.py`` and imports ``_wait_batch_p2p`` in
               ``torchtitan/distributed/dual_pipe_v.py``, which every model package imports, so on torch
               2.4 nothing trains, pipeline parallel or not: ``ImportError: cannot import name
               'OVERLAP_F_B' from 'torch.distributed.pipelining.schedules'``. It uses them only to
               register an overlapped forward-backward callback on ``ScheduleDualPipeV`` with expert
               parallel overlap (``register_custom_function``, torch 2.10).
Torch:         2.9 added the action ``_ComputationType.OVERLAP_F_B`` (a forward of one stage run together
               with a backward of another, ``sub_actions``) and its module-level alias; with
               ``_wait_batch_p2p`` (wait for each work of a batched send/receive); 2.4's
               ``_ComputationType`` has only ``FORWARD`` and ``BACKWARD``, 2.5-2.8's no overlapped action.
Fix:           serve ``_wait_batch_p2p`` as 2.9 has it (``work.wait()`` for each work of the list) and
               ``OVERLAP_F_B`` as the member of a one-member enum named as 2.15's (``_ComputationType``,
               value ``"OVERLAP_F_B"``), so modules importing it load. No schedule of this torch runs it: the
               runtime that pipelining-zbv serves on 2.4 refuses any action list naming it (``invalid
               pipeline action``), and there is no ``register_custom_function`` before torch 2.10.
Upstream:      https://github.com/pytorch/pytorch/blob/v2.15.0/torch/distributed/pipelining/schedules.py
"""

import enum
from typing import Any, Iterable

from torchpatch import Patch

PATCH = Patch(
    id="pipelining-dualpipev-overlap",
    summary="torch.distributed.pipelining.schedules.OVERLAP_F_B and _wait_batch_p2p on torch 2.4-2.8 (names "
    "torchtitan 0.2.2 imports; no schedule here runs the action)",
    torch=">=2.4,<2.9",
    upstream="https://github.com/pytorch/pytorch/blob/v2.15.0/torch/distributed/pipelining/schedules.py",
)

SCHEDULES = "torch.distributed.pipelining.schedules"


class _ComputationType(enum.Enum):
    """torch 2.15's overlapped forward-backward action, alone: this torch's schedules have no such action."""

    OVERLAP_F_B = "OVERLAP_F_B"  # 2.15's value


@PATCH.symbol(SCHEDULES, "OVERLAP_F_B")
def _overlap_f_b() -> _ComputationType:
    return _ComputationType.OVERLAP_F_B


def _wait_batch_p2p(work: Iterable[Any]) -> None:
    """Waits for each ``dist.Work`` of a batched point-to-point exchange (torch 2.9's helper)."""
    for w in work:
        w.wait()


PATCH.symbol(SCHEDULES, "_wait_batch_p2p")(lambda: _wait_batch_p2p)
