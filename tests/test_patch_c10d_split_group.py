"""c10d-split-group: ``torch.distributed.split_group`` (torch 2.4).

On 4 gloo ranks, with TORCHPATCH=1 on torch 2.4 (served) and 2.15 (torch's own, the reference; 2.5-2.9
split NCCL groups only): each rank gets its split's group, with the split's ranks in the
list's order, 2.15's default description, and collectives equal to the one-process computation over
the split's ranks; ranks in no split get ``GroupMember.NON_GROUP_MEMBER``; a subgroup splits the same
way; bad arguments raise 2.15's errors. Natively on 2.4 the name is missing.
"""

import pytest
from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, patch_applies_here, ranks_result, run_json, torch_matches,
    where_patch_applies, where_patch_does_not_apply
)

SCRIPT = """
import datetime, json, torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()

def data(r):  # what global rank r holds
    return torch.randn(2, 3, generator=torch.Generator().manual_seed(10 + r), dtype=torch.float64)

def describe(group, split):  # split: the group's global ranks in group-rank order, or None
    if split is None:
        return [group is c10d.GroupMember.NON_GROUP_MEMBER]
    total = data(rank)
    dist.all_reduce(total, group=group)
    gathered = [torch.empty(2, 3, dtype=torch.float64) for _ in split]
    dist.all_gather(gathered, data(rank), group=group)
    names = [None] * len(split)
    dist.all_gather_object(names, group.group_name, group=group)
    return [group.rank(), group.size(), dist.get_process_group_ranks(group), group.group_desc,
            torch.allclose(total, sum(data(r) for r in split), rtol=1e-12, atol=0),
            all(torch.equal(g, data(r)) for g, r in zip(gathered, split)), len(set(names)) == 1]

def error(call):
    try:
        call()
        return None
    except (RuntimeError, TypeError, ValueError) as exc:
        return [type(exc).__name__, str(exc).split(chr(10))[0]]

out = {"same": dist.split_group is c10d.split_group}
pairs = dist.split_group(split_ranks=[[3, 1], [0, 2]])
out["pairs"] = describe(pairs, [3, 1] if rank in (1, 3) else [0, 2])
alone = dist.split_group(None, [[1]])
out["alone"] = describe(alone, [1] if rank == 1 else None)
everyone = dist.split_group(split_ranks=[[0, 1, 2, 3]])
out["everyone"] = describe(everyone, [0, 1, 2, 3])
sub = dist.new_group([0, 1, 2])
if rank < 3:
    split = dist.split_group(sub, [[2, 0]], timeout=datetime.timedelta(seconds=30), group_desc="mine")
    out["sub"] = describe(split, [2, 0] if rank != 1 else None)
else:
    out["sub"] = error(lambda: dist.split_group(sub, [[0]]))
out["errors"] = {
    "none": error(lambda: dist.split_group()),
    "empty": error(lambda: dist.split_group(split_ranks=[])),
    "empty_split": error(lambda: dist.split_group(split_ranks=[[], [0]])),
    "too_big": error(lambda: dist.split_group(split_ranks=[[0, 1, 2, 3, 4]])),
    "duplicates": error(lambda: dist.split_group(split_ranks=[[0, 0]])),
    "timeout": error(lambda: dist.split_group(split_ranks=[[0]], timeout=5)),
    "backend": error(lambda: dist.split_group(split_ranks=[[0]], backend="nccl")),
    "device": error(lambda: dist.split_group(split_ranks=[[0]], backend="cpu:gloo,mtia:gloo")),
}
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@pytest.mark.skipif(not (patch_applies_here("c10d-split-group") or torch_matches(">=2.15")),
                    reason="served on torch 2.4; torch 2.15's own (gloo groups split from 2.15 on here)")
def test_groups_and_collectives_equal_one_process(tmp_path):
    ranks = ranks_result(SCRIPT, tmp_path=tmp_path, nproc=4, env=clean_env(TORCHPATCH="1"))
    parents = "(parent backends: {'cpu': 'gloo', 'cuda': 'gloo'})"
    for rank, out in enumerate(ranks):
        assert out["same"], out
        pair = [3, 1] if rank in (1, 3) else [0, 2]
        assert out["pairs"] == [pair.index(rank), 2, pair, "default_pg:split:0", True, True, True], (rank, out)
        assert out["alone"] == ([0, 1, [1], "default_pg:split:1", True, True, True] if rank == 1 else [True])
        assert out["everyone"] == [rank, 4, [0, 1, 2, 3], "default_pg:split:2", True, True, True], (rank, out)
        assert out["sub"] == {0: [1, 2, [2, 0], "mine", True, True, True], 1: [True],
                              2: [0, 2, [2, 0], "mine", True, True, True],
                              3: ["ValueError", "Global rank 3 is not part of the parent group -100"]}[rank]
        assert out["errors"] == {
            "none": ["ValueError", "split_ranks cannot be None or empty"],
            "empty": ["ValueError", "split_ranks cannot be None or empty"],
            "empty_split": ["ValueError", "the split group cannot be empty"],
            "too_big": ["ValueError", "the split group's size should be less or equal to the world_size set "
                        "by init_process_group"],
            "duplicates": ["ValueError", "the split group cannot have duplicate ranks"],
            "timeout": ["TypeError", "Expected timeout argument to be of type datetime.timedelta, got 5"],
            "backend": ["ValueError", f"Requested backend 'nccl' is not present in the parent process group {parents}"],
            "device": ["ValueError", f"Requested backend for device 'mtia' is not present in the parent process "
                       f"group {parents}"],
        }, (rank, out["errors"])


PROBE = """
import json, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
import torchpatch
print(json.dumps({"found": [hasattr(dist, "split_group"), hasattr(c10d, "split_group")],
                  "status": torchpatch.status().get("c10d-split-group")}))
"""


@where_patch_applies("c10d-split-group", "torch 2.5 added split_group")
def test_missing_natively():
    assert run_json(PROBE, env=clean_env())["found"] == [False, False]
    served = run_json(PROBE, env=clean_env(TORCHPATCH="1"))
    assert served == {"found": [True, True], "status": "applied"}, served


@where_patch_does_not_apply("c10d-split-group")
def test_inactive_where_torch_has_it():
    assert run_json(PROBE, env=clean_env(TORCHPATCH="1"))["status"] is None
