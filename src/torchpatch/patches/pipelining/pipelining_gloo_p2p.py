"""pipelining-gloo-p2p: pipeline schedules wait for every send and receive of a batch, torch 2.4-2.7.

What breaks:   ``Schedule1F1B`` (torchtitan's default pipeline schedule) hangs on gloo, then dies
               with ``RuntimeError: [.../unbound_buffer.cc:81] Timed out waiting ...ms for recv
               operation to complete``, with or without ``input_args``: CPU pipeline training.
Torch:         2.4-2.7: ``torch.distributed.pipelining.schedules._batch_p2p`` returns
               ``dist.batch_isend_irecv(ops).pop()``, the last of the works. NCCL coalesces a batch
               into one work, so that is all of it there; gloo returns one work per operation, so
               the schedule waits for the last one only and runs ahead of the others (1F1B fuses a
               send with a receive). Fixed in torch 2.8 by waiting for every work.
Fix:           ``_batch_p2p`` returns one object whose ``wait()`` waits for every work of the batch
               (the very work when there is only one, as with NCCL); the schedules call it as before.
Upstream:      https://github.com/pytorch/pytorch/pull/152938 (fixes pytorch#132644, torch 2.8)
"""

from typing import Any, List, Optional

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="pipelining-gloo-p2p",
    summary="pipeline schedules wait for every P2P work of a batch (gloo 1F1B hang)",
    torch=">=2.4,<2.8",
    upstream="https://github.com/pytorch/pytorch/pull/152938",
    behaviour="Schedule1F1B and the other schedules on gloo",
)


class _Works:
    """The works of one ``batch_isend_irecv``, waited for together."""

    def __init__(self, works: List[Any]) -> None:
        self.works = works

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        for work in self.works:
            work.wait(*args, **kwargs)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def _batch_p2p(p2p_ops: List[Any], desc: Optional[str] = None) -> Any:
    """``batch_isend_irecv`` of ``p2p_ops``: one work to wait for all of them (None for no ops)."""
    import torch.distributed as dist

    if not p2p_ops:
        return None
    works = dist.batch_isend_irecv(p2p_ops)
    return works[0] if len(works) == 1 else _Works(works)


@PATCH.on_import("torch.distributed.pipelining.schedules")
def wait_for_every_work(patcher: Patcher, schedules: Any) -> bool:
    # A probe, no communication: with no ops, torch 2.4-2.7's ``_batch_p2p`` (one work) returns None,
    # torch 2.8's (the list of works, each waited for) an empty list.
    if schedules._batch_p2p([]) is not None:
        return False  # torch already waits for every work
    patcher.setattr(schedules, "_batch_p2p", _batch_p2p)
    return True
