"""c10d-split-group: ``torch.distributed.split_group`` on torch 2.4.

What breaks:   code written for newer torch splits a process group into disjoint subgroups with
               ``dist.split_group(parent_pg, split_ranks=[[0, 1], [2, 3]])`` and dies on torch 2.4 with
               ``AttributeError: module 'torch.distributed' has no attribute 'split_group'``.
Torch:         2.5 added ``split_group(parent_pg=None, split_ranks=None, timeout=None, pg_options=None,
               group_desc=None)`` (NCCL only, through the communicator split of the C++
               ``ProcessGroup.split_group``); 2.15's also splits gloo groups and takes ``backend`` (the
               parent's per-device backends the child keeps). Every rank of the parent enters with the
               same ``split_ranks`` (lists of parent group ranks, disjoint); each gets the group of its
               split, whose group ranks follow the list's order, or ``GroupMember.NON_GROUP_MEMBER``.
               torch 2.4 has what a new group of given ranks needs (``_new_process_group_helper``),
               which ``new_group`` uses after sorting the ranks.
Fix:           serve ``split_group`` in ``torch.distributed.distributed_c10d`` and ``torch.distributed``
               with 2.15's signature, checks and errors (in 2.15's order), default ``group_desc``
               (``<parent's desc>:split:<n>``, n counting this rank's splits of the parent) and group
               name (the hash of the split's ranks), making this rank's split as a new group of the
               parent's backend in the split's order, bound to the parent's device. Gloo and NCCL split
               (2.15's), other backends raise 2.15's error unless they say they support splitting. On
               NCCL a new group is a new communicator, or, where torch 2.4 splits every group from the
               default group's communicator (the default group bound to a device), a split of that,
               which every rank of the default group enters: there a parent smaller than the default
               group raises a RuntimeError saying so instead of hanging.
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/distributed_c10d.py
               (``split_group``)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

from torchpatch import Patch

if TYPE_CHECKING:
    from datetime import timedelta

    from torch.distributed import ProcessGroup

PATCH = Patch(
    id="c10d-split-group",
    summary="torch.distributed.split_group on torch 2.4: this rank's split of a parent group as a new "
    "group of the parent's backend, with 2.15's checks and errors",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/distributed_c10d.py",
)

SPLITTING_BACKENDS = ("gloo", "nccl")  # the backends of torch 2.4 that torch 2.15 splits
NO_SPLITTING = "No backend for the parent process group or its backend does not support splitting"
_splits: Dict[str, int] = {}  # parent group name -> how many times this rank split it


def split_group(
    parent_pg: Optional["ProcessGroup"] = None,
    split_ranks: Optional[List[List[int]]] = None,
    timeout: Optional["timedelta"] = None,
    pg_options: Any = None,
    group_desc: Optional[str] = None,
    backend: Any = None,
) -> Any:
    """Create a new process group split from ``parent_pg`` (default: the default group): this rank's
    split of ``split_ranks`` (parent group ranks), or ``GroupMember.NON_GROUP_MEMBER``."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    if not split_ranks:
        raise ValueError("split_ranks cannot be None or empty")
    world = c10d._world
    default_pg = c10d._get_default_group()
    global_rank, world_size = default_pg.rank(), default_pg.size()
    parent_pg = parent_pg or default_pg
    if parent_pg not in world.pg_group_ranks:
        raise ValueError(f"Group {parent_pg} is not registered")
    group_ranks = world.pg_group_ranks[parent_pg]
    if global_rank not in group_ranks:
        raise ValueError(f"Global rank {global_rank} is not part of the parent group {parent_pg}")
    parent_rank = group_ranks[global_rank]
    to_global = {group_rank: rank for rank, group_rank in group_ranks.items()}

    devices = {device.type for device in parent_pg._device_types}
    if torch.cuda.is_available() and "cuda" in devices:
        parent_backend = parent_pg._get_backend(torch.device("cuda"))
    elif "cpu" in devices:
        parent_backend = parent_pg._get_backend(torch.device("cpu"))
    else:
        raise RuntimeError(NO_SPLITTING)
    splits_here = parent_backend.name() in SPLITTING_BACKENDS
    if not (splits_here or parent_backend.supports_splitting):
        raise RuntimeError(NO_SPLITTING)
    count = _splits.get(parent_pg.group_name, 0)
    if splits_here and group_desc is None:
        group_desc = f"{parent_pg.group_desc}:split:{count}"

    parent_backend_str = world.pg_map[parent_pg][0]
    if backend is not None:
        _check_backend_filter(str(backend).lower(), parent_backend_str, devices)
    child_backend = c10d.Backend(parent_backend_str if backend is None else str(backend))
    if timeout is None:
        timeout = c10d._get_default_timeout(child_backend)
    c10d._check_valid_timeout(timeout)

    my_split = split_ranks[0]  # ranks in no split make the first one's group and get no group
    for ranks in split_ranks:
        if len(ranks) == 0:
            raise ValueError("the split group cannot be empty")
        if len(ranks) > world_size:
            raise ValueError("the split group's size should be less or equal to the world_size set by "
                             "init_process_group")
        if len(ranks) != len(set(ranks)):
            raise ValueError("the split group cannot have duplicate ranks")
        if parent_rank in ranks:
            my_split = ranks
            break
    if default_pg.bound_device_id and parent_pg.size() < world_size and c10d._get_split_source(default_pg):
        raise RuntimeError("split_group: torch 2.4 makes every NCCL group of a default group bound to a "
                           "device by splitting the default group's communicator, which every rank of the "
                           "default group enters; split the default group instead")

    group_name = c10d._process_group_name(my_split, use_hashed_name=True)
    global_ranks = [to_global[rank] for rank in my_split]
    _splits[parent_pg.group_name] = count + 1
    pg, _ = c10d._new_process_group_helper(
        len(my_split), my_split.index(parent_rank) if parent_rank in my_split else None, global_ranks,
        child_backend, world.pg_map[default_pg][1], group_name, pg_options=pg_options, timeout=timeout,
        device_id=parent_pg.bound_device_id, group_desc=group_desc,
    )
    if pg is c10d.GroupMember.NON_GROUP_MEMBER:
        return pg
    world.pg_group_ranks[pg] = {rank: group_rank for group_rank, rank in enumerate(global_ranks)}
    return pg


def _check_backend_filter(requested: str, parent_backend_str: str, devices: set) -> None:
    """2.15's errors for a ``backend`` that is not a subset of the parent's per-device backends."""
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    parent = {device: str(name) for device, name in
              BackendConfig(Backend(parent_backend_str)).get_device_backend_map().items() if device in devices}
    if ":" in requested:
        wanted: Dict[str, str] = {}
        for part in requested.split(","):
            pieces = part.split(":")
            if len(pieces) != 2:
                raise ValueError(f"Invalid device:backend pairing '{part}' in '{requested}'. Expected format: "
                                 "'<device_type1>:<backend1>,<device_type2>:<backend2>...'")
            if pieces[0].strip() in wanted:
                raise ValueError(f"Duplicate device type '{pieces[0].strip()}' in backend string '{requested}'")
            wanted[pieces[0].strip()] = pieces[1].strip()
    else:
        wanted = {device: name for device, name in parent.items() if name == requested}
        if not wanted:
            raise ValueError(f"Requested backend '{requested}' is not present in the parent process group "
                             f"(parent backends: {parent})")
    for device, name in wanted.items():
        if device not in parent:
            raise ValueError(f"Requested backend for device '{device}' is not present in the parent process "
                             f"group (parent backends: {parent})")
        if parent[device] != name:
            raise ValueError(f"Backend mismatch for device '{device}': parent has '{parent[device]}', requested "
                             f"'{name}'. Backend names must match exactly when filtering split_group backends.")


for _module in ("torch.distributed.distributed_c10d", "torch.distributed"):
    PATCH.symbol(_module, "split_group")(lambda: split_group)
