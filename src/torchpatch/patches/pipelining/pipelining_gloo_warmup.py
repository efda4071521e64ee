"""pipelining-gloo-warmup: the P2P warm-up of a pipeline schedule sends what its peer receives, torch 2.9.

What breaks:   the first ``step()`` of any pipeline schedule on gloo (torchtitan's ``--parallelism.
               pipeline_parallel_degree``: CPU pipeline training) kills every process with
               ``C++ abort: [enforce fail at .../gloo/transport/tcp/pair.cc:456] op.preamble.length
               <= op.nbytes. 8 vs 4. Received data size doesn't match expected size``.
Torch:         2.9: ``_PipelineStageBase._get_init_p2p_neighbors_ops`` (the warm-up each schedule
               posts before its first step, one dummy message each way between neighbouring stages)
               sends ``torch.tensor(stage_index)``, an int64 (8 bytes), into ``torch.zeros(1)``, the
               default dtype (float32: 4 bytes). NCCL does not check the size; gloo aborts, unless
               the default dtype happens to be 8 bytes wide. Fixed in torch 2.10: both float32.
Fix:           the warm-up's tensors, sent and received, are float32 (the values are never read).
               The hook asks torch's own method, without communicating, which dtypes it posts; where
               they already agree it changes nothing.
Upstream:      https://github.com/pytorch/pytorch/pull/165539 (fixes pytorch#165143, torch 2.10)
"""

import types
from typing import Any, Callable, Dict, List

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="pipelining-gloo-warmup",
    summary="pipelining's P2P warm-up sends and receives float32 alike (gloo size abort)",
    torch=">=2.9,<2.10",
    upstream="https://github.com/pytorch/pytorch/pull/165539",
    behaviour="the first step of every pipeline schedule on gloo",
    errors=(
        Error(r"op\.preamble\.length <= op\.nbytes\. \d+ vs \d+\. Received data size doesn't match expected size",
              "op.preamble.length <= op.nbytes. 8 vs 4. Received data size doesn't match expected size"),
    ),
)


class _StandIn:
    """A stage for the probe: the attributes it is given, None for any other (its groups)."""

    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)

    def __getattr__(self, name: str) -> None:
        return None


def warmup_dtypes(method: Callable[[Any], List[Any]]) -> List[Any]:
    """The dtypes of the tensors ``method`` (torch's ``_get_init_p2p_neighbors_ops``) posts for a
    middle stage, sent and received: it runs on a stand-in stage with a ``dist`` that only records."""
    import torch

    recorder = types.SimpleNamespace(isend="isend", irecv="irecv", P2POp=lambda op, tensor, **_kw: tensor)
    namespace: Dict[str, Any] = dict(method.__globals__, dist=recorder)
    probe = types.FunctionType(method.__code__, namespace, method.__name__, method.__defaults__, method.__closure__)
    stage = _StandIn(stage_index=1, stage_index_to_group_rank={0: 0, 1: 1, 2: 0}, device=torch.device("cpu"),
                     is_first=False, is_last=False)
    return [tensor.dtype for tensor in probe(stage)]


def _float32_tensors(wrapped: Callable[..., List[Any]], _instance: Any, args: Any, kwargs: Any) -> List[Any]:
    import torch

    ops = wrapped(*args, **kwargs)
    for op in ops:
        op.tensor = op.tensor.to(torch.float32)
    return ops


@PATCH.on_import("torch.distributed.pipelining.stage")
def same_dtype_both_ways(patcher: Patcher, stage: Any) -> bool:
    method = vars(stage._PipelineStageBase).get("_get_init_p2p_neighbors_ops")
    if method is None or len(set(warmup_dtypes(method))) == 1:
        return False  # no such warm-up, or its tensors already agree
    patcher.wrap(stage._PipelineStageBase, "_get_init_p2p_neighbors_ops", _float32_tensors)
    return True
