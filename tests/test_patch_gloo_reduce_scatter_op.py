"""gloo-reduce-scatter-op: a reduce-scatter on gloo reduces with its op, not always SUM.

On 2 real ranks (gloo), torch 2.4's gloo reduce-scatter sums whatever op it is given: DTensor's
``Partial("max"/"min"/"avg")`` redistributed to ``Shard(0)`` (even and uneven sizes, a 1-D mesh and
the size-2 dimension of a (2, 1) and of a (1, 2) mesh), ``funcol.reduce_scatter_tensor`` (scatter dimension 0 and
1) and ``reduce_scatter_tensor_coalesced``, and ``dist.reduce_scatter_tensor`` (also with
``async_op=True`` and in a coalescing manager) give the sum of the ranks' tensors; natively and with
the patch switched off every such case differs from the reduction computed locally from every
rank's input, with ``TORCHPATCH=1`` every case equals it. SUM and ``Partial -> Replicate`` (an
all-reduce, right natively) are torch's own and right in every run. On torch 2.9 and 2.15 (fixed
upstream) the same script is right and the patch is not applied. The patch's one-rank probe tells
the two kinds of torch apart by behaviour; it is asked only by a non-SUM reduce-scatter on gloo.
"""

import pytest

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, patch_applies_here, ranks_result, run_json,
    through_patch_range, torch_matches
)

PATCH_ID = "gloo-reduce-scatter-op"

SCRIPT = """
import datetime, json, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, init_device_mesh
except ImportError:  # torch 2.4 without torchpatch
    from torch.distributed._tensor import DTensor, Replicate, Shard, init_device_mesh
    from torch.distributed._tensor.placement_types import Partial
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
OPS = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG,
       "product": dist.ReduceOp.PRODUCT, "sum": dist.ReduceOp.SUM}

def data(r, rows=4, cols=3):  # what rank r holds; every rank can compute every rank's tensor
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(100 + r))

def reduced(op, rows=4, cols=3):  # the reduction over the ranks, computed here in one process
    s = torch.stack([data(r, rows, cols) for r in range(world)])
    return {"max": s.amax(0), "min": s.amin(0), "avg": s.sum(0) / world, "product": s.prod(0), "sum": s.sum(0)}[op]

def waited(y):
    return y.wait() if hasattr(y, "wait") else y

mesh = init_device_mesh("cpu", (world,))
mesh2 = init_device_mesh("cpu", (world, 1))
mesh12 = init_device_mesh("cpu", (1, world))
out = {}
for op in ("max", "min", "avg", "sum"):
    for rows in (4, 5):  # 5 rows: uneven shards (DTensor pads for the reduce-scatter)
        d = DTensor.from_local(data(rank, rows), mesh, [Partial(op)]).redistribute(mesh, [Shard(0)])
        ref = reduced(op, rows)
        out[f"dtensor/{op}/{rows}/shard"] = torch.equal(d.to_local(), ref.chunk(world)[rank]) and torch.equal(d.full_tensor(), ref)
    d = DTensor.from_local(data(rank), mesh2, [Partial(op), Replicate()]).redistribute(mesh2, [Shard(0), Replicate()])
    out[f"dtensor/{op}/mesh2d/shard"] = torch.equal(d.full_tensor(), reduced(op))
    d = DTensor.from_local(data(rank), mesh12, [Replicate(), Partial(op)]).redistribute(mesh12, [Replicate(), Shard(0)])
    out[f"dtensor/{op}/mesh12/shard"] = torch.equal(d.full_tensor(), reduced(op))
    out[f"funcol/{op}/dim0"] = torch.equal(waited(funcol.reduce_scatter_tensor(data(rank), op, 0, mesh)),
                                           reduced(op).chunk(world)[rank])
    out[f"funcol/{op}/dim1"] = torch.equal(waited(funcol.reduce_scatter_tensor(data(rank, 3, 4), op, 1, mesh)),
                                           reduced(op, 3, 4).chunk(world, dim=1)[rank])
    ys = funcol.reduce_scatter_tensor_coalesced([data(rank), data(rank, 3, 4)], op, [0, 1], mesh)
    out[f"funcol/{op}/coalesced"] = (torch.equal(waited(ys[0]), reduced(op).chunk(world)[rank])
                                     and torch.equal(waited(ys[1]), reduced(op, 3, 4).chunk(world, dim=1)[rank]))
for op in ("max", "min", "avg", "product", "sum"):
    o = torch.empty(4 // world, 3)
    dist.reduce_scatter_tensor(o, data(rank), op=OPS[op])
    out[f"c10d/{op}"] = torch.equal(o, reduced(op).chunk(world)[rank])
    o = torch.full((4 // world, 3), float("nan"))
    dist.reduce_scatter_tensor(o, data(rank), op=OPS[op], async_op=True).wait()
    out[f"c10d/{op}/async"] = torch.equal(o, reduced(op).chunk(world)[rank])
    o1, o2 = torch.empty(4 // world, 3), torch.empty(8 // world, 2)
    with dist._coalescing_manager(async_ops=False):
        dist.reduce_scatter_tensor(o1, data(rank), op=OPS[op])
        dist.reduce_scatter_tensor(o2, data(rank, 8, 2), op=OPS[op])
    out[f"c10d/{op}/coalescing_manager"] = (torch.equal(o1, reduced(op).chunk(world)[rank])
                                            and torch.equal(o2, reduced(op, 8, 2).chunk(world)[rank]))
for op in ("max", "min"):  # an all-reduce: right on every torch
    d = DTensor.from_local(data(rank), mesh, [Partial(op)]).redistribute(mesh, [Replicate()])
    out[f"dtensor/{op}/replicate"] = torch.equal(d.to_local(), reduced(op))
# The brief's example: rank 0 holds 1.0, rank 1 holds 4.0; Partial("max") to Shard(0) on 2 ranks.
x = torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([4.0, 0.5])
example = DTensor.from_local(x, mesh, [Partial("max")]).redistribute(mesh, [Shard(0)]).to_local()
import torchpatch
out["example_rank_value"] = example.tolist()
out["status"] = torchpatch.status().get("PATCH_ID")
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)).replace("PATCH_ID", PATCH_ID) + LEAVE_WITHOUT_TEARDOWN

# Cases that reduce with SUM or by an all-reduce: right with or without the fix.
RIGHT_ANYWAY = ("/sum", "/replicate")


def _run(tmp_path, env):
    return ranks_result(SCRIPT, tmp_path=tmp_path, env=env, timeout=240)


@only_torch(">=2.3,<2.7", "torch 2.3-2.6's gloo reduce-scatter drops its op (2.4 in the matrix)")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_GLOO_REDUCE_SCATTER_OP": "0"}], ids=["unset", "opted-out"])
def test_native_reduce_scatter_sums(tmp_path, env):
    for rank, out in enumerate(_run(tmp_path, clean_env(**env))):
        assert out.pop("status") is None
        # rank 0 gets max(1, 4) = 4 and max(2, 0.5) = 2 from a max; the sum 5 and 2.5 come back
        assert out.pop("example_rank_value") == ([5.0] if rank == 0 else [2.5])
        wrong = sorted(k for k, v in out.items() if v is not True)
        assert wrong == sorted(k for k in out if not any(s in k for s in RIGHT_ANYWAY)), out


@through_patch_range(PATCH_ID, "torch 2.1's gloo has no tensor reduce-scatter (dist.reduce_scatter_tensor raises)")
def test_reduce_scatter_reduces_with_its_op(tmp_path):
    for rank, out in enumerate(_run(tmp_path, clean_env(TORCHPATCH="1"))):
        assert out.pop("status") == ("applied" if patch_applies_here(PATCH_ID) else None)
        assert out.pop("example_rank_value") == ([4.0] if rank == 0 else [2.0])
        assert all(v is True for v in out.values()), {k: v for k, v in out.items() if v is not True}


PROBE = """
import json, torch
from torchpatch.patches.collectives.gloo_reduce_scatter_op import gloo_ignores_reduce_scatter_op
print(json.dumps({"ignores_op": gloo_ignores_reduce_scatter_op()}))
"""


@pytest.mark.parametrize("spec, ignores", [(">=2.3,<2.7", True), (">=2.9", False)], ids=["affected", "fixed"])
def test_probe_tells_the_bug_by_behaviour(spec, ignores):
    """The hook's one-rank probe, asked without TORCHPATCH: True where gloo drops the op."""
    if not torch_matches(spec):
        pytest.skip(f"needs torch {spec}")
    assert run_json(PROBE, env=clean_env()) == {"ignores_op": ignores}


NOT_ASKED = """
import json, torch, torch.distributed as dist, torch.distributed._functional_collectives as funcol
from torchpatch.patches.collectives import gloo_reduce_scatter_op as patch
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
o = torch.empty(2)
dist.reduce_scatter_tensor(o, torch.ones(2))  # SUM: torch's own, nothing to ask
funcol.reduce_scatter_tensor(torch.ones(2), "sum", 0, dist.group.WORLD).wait()
asked = patch._probe is not None
dist.reduce_scatter_tensor(o, torch.ones(2), op=dist.ReduceOp.MAX)  # asks, once
import torchpatch
print(json.dumps({"status": torchpatch.status().get("gloo-reduce-scatter-op"), "asked": [asked, patch._probe]}))
"""


@only_torch(">=2.3,<2.7")
def test_probe_is_asked_only_by_a_reduce_scatter_that_needs_it():
    assert run_json(NOT_ASKED, env=clean_env(TORCHPATCH="1")) == {"status": "applied", "asked": [False, True]}
