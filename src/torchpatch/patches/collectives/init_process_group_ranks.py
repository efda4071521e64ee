"""init-process-group-ranks: ``init_process_group(..., _ranks=...)`` on torch 2.4-2.9.

What breaks:   torchtitan 0.3.0 and 0.2.2 always pass torch 2.10's private argument (``_ranks=[]`` unless it is
               told the default group's ranks), so on torch 2.4-2.9 nothing starts: ``TypeError:
               init_process_group() got an unexpected keyword argument '_ranks'``.
Torch:         2.10 added ``_ranks``: empty or ``None`` changes nothing; a rank list names the default
               group by the hash of its ranks (``_process_group_name(_ranks, use_hashed_name=True)``)
               instead of the first unhashed name. 2.9 computes the name the same way, from ``[]`` only; 2.4's
               hash of a rank list lacks 2.15's salt (the group count).
Fix:           wrap 2.4-2.9's ``init_process_group`` (``torch.distributed`` re-exports the same function):
               it takes ``_ranks``; given a rank list, the default group gets 2.15's hashed name (on 2.4
               computed as 2.15 does).
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/distributed_c10d.py
"""

from types import ModuleType
from typing import Any, Callable, Dict, Optional, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="init-process-group-ranks",
    summary="init_process_group(_ranks=...) on torch 2.4-2.9 (torch 2.10's private argument; torchtitan 0.3.0 "
    "and 0.2.2 pass it)",
    torch=">=2.4,<2.10",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/distributed_c10d.py",
    behaviour="init_process_group(_ranks=...)",
    errors=(
        Error(r"init_process_group\(\) got an unexpected keyword argument '_ranks'",
              "TypeError: init_process_group() got an unexpected keyword argument '_ranks'"),
    ),
)


def _named_by_ranks(c10d: ModuleType, ranks: list) -> Callable[..., str]:
    """``_process_group_name`` that names the default group (``[]``) by the hash of ``ranks``: 2.9's own
    hashed name; on 2.4, whose hash lacks the salt, 2.15's (the ranks and the group count, which it advances)."""
    original = c10d._process_group_name

    def process_group_name(group_ranks: Any, use_hashed_name: bool) -> str:
        if group_ranks:
            return original(group_ranks, use_hashed_name)
        if hasattr(c10d, "_hash_ranks_to_str"):
            return original(ranks, use_hashed_name=True)
        import hashlib

        salted = "_".join(["_".join(map(str, ranks)), str(c10d._world.group_count)])
        c10d._world.group_count += 1
        return hashlib.sha1(salted.encode("utf-8")).hexdigest()

    return process_group_name


def _taking_ranks(c10d: ModuleType) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        ranks: Optional[list] = kwargs.pop("_ranks", None)
        if not ranks:
            return wrapped(*args, **kwargs)
        original = c10d._process_group_name
        c10d._process_group_name = _named_by_ranks(c10d, list(ranks))
        try:
            return wrapped(*args, **kwargs)
        finally:
            c10d._process_group_name = original

    return wrapper


@PATCH.on_import("torch.distributed.distributed_c10d")
def take_ranks(patcher: Patcher, c10d: ModuleType) -> Optional[bool]:
    import inspect

    if "_ranks" in inspect.signature(c10d.init_process_group).parameters:
        return False
    import torch.distributed as dist

    original = c10d.init_process_group
    proxy = patcher.wrap(c10d, "init_process_group", _taking_ranks(c10d))
    if getattr(dist, "init_process_group", None) is original:
        patcher.setattr(dist, "init_process_group", proxy)
    return True
