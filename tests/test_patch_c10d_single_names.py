"""c10d-single-names: ``all_gather_single``, ``reduce_scatter_single`` (torch 2.4-2.12), ``gather_single``
and ``gather_into_tensor`` (torch 2.4-2.13) in ``torch.distributed`` and ``distributed_c10d``.

On 2 gloo ranks, from torch 2.4 on with TORCHPATCH=1 (served where the patch applies, torch's own from
2.13 / 2.14, the reference on 2.15): ``all_gather_single`` and
``reduce_scatter_single`` ("sum", "max") equal the computation on one process with every rank's
tensor, and the deprecated names' results, synchronously and with ``async_op=True``, on the default
group, a ``new_group`` of both ranks and a one-rank group. ``gather_single`` checks its arguments as
2.15 does and, gloo having no gather into one tensor, raises 2.15's error. Natively before the patch
range ends the names are missing.
"""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, ranks_result, run_json, through_patch_range,
    until_patch_range_ends, where_patch_does_not_apply
)

NAMES = ("all_gather_single", "reduce_scatter_single", "gather_single", "gather_into_tensor")

SCRIPT = """
import datetime, json, torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
both = dist.new_group(list(range(world)))
alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group

def data(r, rows):  # what rank r holds
    return torch.randn(rows, 3, generator=torch.Generator().manual_seed(10 + r), dtype=torch.float64)

def finish(work):
    if work is not None:
        work.wait()

out = {"same": {n: getattr(dist, n) is getattr(c10d, n) for n in NAMES}}
for gname, group, members in (("default", None, range(world)), ("both", both, range(world)), ("alone", alone, [rank])):
    for async_op in (False, True):
        key = f"{gname}/async={async_op}"
        x = data(rank, 2)
        ref = torch.cat([data(r, 2) for r in members])
        new, old = torch.empty_like(ref), torch.empty_like(ref)
        finish(dist.all_gather_single(new, x, group=group, async_op=async_op))
        finish(dist.all_gather_into_tensor(old, x, group, async_op))
        out[f"all_gather/{key}"] = [torch.equal(new, ref), torch.equal(new, old)]
        big = data(rank, 2 * len(members))
        mine = slice(2 * list(members).index(rank), 2 * list(members).index(rank) + 2)
        for op, reduce in (("SUM", lambda ts: sum(ts)), ("MAX", lambda ts: torch.stack(ts).amax(0))):
            new, old = torch.empty(2, 3, dtype=big.dtype), torch.empty(2, 3, dtype=big.dtype)
            finish(dist.reduce_scatter_single(new, big, op=getattr(dist.ReduceOp, op), group=group, async_op=async_op))
            finish(dist.reduce_scatter_tensor(old, big, getattr(dist.ReduceOp, op), group, async_op))
            ref = reduce([data(r, 2 * len(members)) for r in members])[mine]
            out[f"reduce_scatter/{op}/{key}"] = [torch.allclose(new, ref, rtol=1e-12, atol=0), torch.equal(new, old)]

def error(call):
    try:
        call()
        return None
    except (RuntimeError, ValueError) as exc:
        return [type(exc).__name__, str(exc).split(chr(10))[0]]

x = data(rank, 2)
out["stacked"] = error(lambda: dist.all_gather_single(torch.empty(world, 2, 3, dtype=x.dtype), x))  # gloo: dim 0 only
gather_tensor = torch.zeros(world * 2, 3, dtype=x.dtype)
out["gather"] = {name: {
    "gloo": error(lambda: getattr(dist, name)(x, gather_tensor if rank == 0 else None, dst=0)),
    "group_dst": error(lambda: getattr(dist, name)(x, gather_tensor if rank == 0 else None, group=both, group_dst=0)),
    "both_dsts": error(lambda: getattr(dist, name)(x, gather_tensor, dst=0, group_dst=0)),
    "no_output": error(lambda: getattr(dist, name)(x, None, dst=rank)),
    "dtypes": error(lambda: getattr(dist, name)(x, gather_tensor.float(), dst=rank)),
} for name in ("gather_single", "gather_into_tensor")}
import torchpatch
out["status"] = torchpatch.status().get("c10d-single-names")
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)).replace("NAMES", repr(NAMES)) + LEAVE_WITHOUT_TEARDOWN


@through_patch_range("c10d-single-names", "served, then torch's own (2.15: the reference)")
def test_results_equal_one_process_and_the_old_names(tmp_path):
    ranks = ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"))
    for out in ranks:
        assert out["same"] == {name: True for name in NAMES}, out["same"]
        results = {key: value for key, value in out.items() if key.startswith(("all_gather/", "reduce_scatter/"))}
        assert len(results) == 18 and all(all(v) for v in results.values()), results
        assert out["stacked"] == ["RuntimeError", "ProcessGroupGloo::allgather: invalid tensor size at index 0 "
                                  "(expected (2, 3), got (1, 2, 3))"], out["stacked"]
        for name, errors in out["gather"].items():
            assert errors == {
                "gloo": ["RuntimeError", "Backend gloo does not support gather_single"],
                "group_dst": ["RuntimeError", "Backend gloo does not support gather_single"],
                "both_dsts": ["ValueError", "Can't specify both group_rank and global_rank"],
                "no_output": ["ValueError", "gather_tensor must be specified on the destination rank"],
                "dtypes": ["ValueError", "Invalid usage of tensors with different dtypesFound torch.float64 and  torch.float32"],
            }, (name, errors)


PROBE = """
import json, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
import torchpatch
print(json.dumps({"names": {name: [hasattr(dist, name), hasattr(c10d, name)] for name in NAMES},
                  "status": torchpatch.status().get("c10d-single-names")}))
""".replace("NAMES", repr(NAMES))


@until_patch_range_ends("c10d-single-names", since="2.4")
def test_missing_natively():
    out = run_json(PROBE, env=clean_env())
    lacking = [name for name, found in out["names"].items() if found == [False, False]]
    assert lacking == list(NAMES) or lacking == ["gather_single", "gather_into_tensor"], out  # 2.13 has the first two
    served = run_json(PROBE, env=clean_env(TORCHPATCH="1"))
    assert served["status"] == "applied" and all(found == [True, True] for found in served["names"].values()), served


@where_patch_does_not_apply("c10d-single-names")
def test_inactive_where_torch_has_them():
    out = run_json(PROBE, env=clean_env(TORCHPATCH="1"))
    assert out["status"] is None, out
