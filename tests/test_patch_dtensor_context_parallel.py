"""dtensor-context-parallel: ``torch.distributed.tensor.experimental.context_parallel`` served on torch
2.5 as the very function of 2.5's ``_attention`` module; torch's own from 2.6 on. The 2-rank script is
the same served (2.5) and native (2.6+, 2.15 in CI): each rank holds its contiguous sequence shard of a
buffer inside the context (torch >= 2.6 without its default load balancing, which 2.5 does not have)
and the whole buffer after it. torch 2.5 is not in CI's matrix: tested on 2.5.1 by hand at a023f3a, not in
CI."""

from conftest import LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, ranks_result, run_py, where_patch_applies

SCRIPT = r"""
import json, os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
import torch.distributed.tensor.experimental._attention as attention
import torchpatch

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
options = getattr(attention, "_cp_options", None)
if options is not None:  # torch >= 2.6 reorders the sequence for load balancing by default
    options.enable_load_balance = False
mesh = init_device_mesh("cpu", (world,))
whole = torch.arange(2.0 * 4 * world).reshape(2, 4 * world)
buffer = whole.clone()
with context_parallel(mesh, buffers=[buffer], buffer_seq_dims=[1]):
    inside = torch.equal(buffer, whole.chunk(world, dim=1)[rank])
out = {
    "own": context_parallel is attention.context_parallel,
    "inside": inside,
    "restored": torch.equal(buffer, whole),
    "status": torchpatch.status().get("dtensor-context-parallel"),
}
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(dict(out, ranks_agree=all(g == gathered[0] for g in gathered[1:]))), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


def run(tmp_path) -> dict:
    out = ranks_result(SCRIPT, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path)
    assert out.pop("ranks_agree"), out
    assert out["own"] and out["inside"] and out["restored"], out
    return out


@where_patch_applies("dtensor-context-parallel", "torch 2.5 keeps context_parallel in experimental._attention")
def test_native_failure():
    proc = run_py("from torch.distributed.tensor.experimental import context_parallel")
    assert "ImportError: cannot import name 'context_parallel' from 'torch.distributed.tensor.experimental'" in (
        proc.stderr), proc.stderr[-2000:]


@where_patch_applies("dtensor-context-parallel")
def test_served_on_two_ranks(tmp_path):
    assert run(tmp_path)["status"] == "applied"


@only_torch(">=2.6", "torch's own context_parallel: the reference")
def test_inactive_where_native(tmp_path):
    assert run(tmp_path)["status"] is None
