"""dtensor-spec-aliasing: indexing a DTensor leaves the DTensor's own spec alone.

On 2 ranks (gloo), a ``(1, 18, 16, 8)`` tensor as a DTensor replicated and sharded on dim 2 is indexed
on dim 1 again and again (``w[:, 16]``, ``w[:, 17]``, ``w[:, 5]``, ``w[:, -1]``: torchtitan 0.3's split
of its fused ``wqkv`` weight) and reshaped; every result's shape and values are compared with the same
operations on the plain tensor. Torch 2.10 and later do this right natively (the newest torch
validates the expectation); torch 2.8-2.9 natively write each result's shape into ``w``'s spec, so the
next index of the replicated one answers for ``w[:, 16]`` (and then raises); TORCHPATCH=1 gives the
plain tensor's results there.
"""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, patch_applies_here, ranks_result, through_patch_range,
    where_patch_applies
)

RANKS = """
import datetime, json, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, W = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (W,))
torch.manual_seed(0)
full = torch.randn(1, 18, 16, 8)
out = {}
for name, placement in (("replicated", Replicate()), ("sharded", Shard(2))):
    w = distribute_tensor(full, mesh, [placement])
    wrong = []
    for i in (16, 17, 5, -1):
        try:
            got = w[:, i].reshape(-1, 8)
            if tuple(got.shape) != tuple(full[:, i].reshape(-1, 8).shape):
                wrong.append(f"w[:, {i}] has shape {tuple(got.shape)}")
            elif not torch.equal(got.full_tensor(), full[:, i].reshape(-1, 8)):
                wrong.append(f"w[:, {i}] has other values")
        except Exception as exc:
            wrong.append(f"w[:, {i}] raises {type(exc).__name__}")
    out[name] = wrong or "as the plain tensor"
import torchpatch
out["status"] = torchpatch.status().get("dtensor-spec-aliasing")
gathered = [None] * W
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@where_patch_applies("dtensor-spec-aliasing", "select writes its output shape into the input's spec")
def test_native_indexing_changes_the_dtensors_shape(tmp_path):
    for out in ranks_result(RANKS, tmp_path=tmp_path, env=clean_env(), timeout=180):
        assert out["status"] is None
        assert out["replicated"] != "as the plain tensor", out
        assert out["replicated"][0] == "w[:, 17] has shape (1, 8)", out  # w[:, 16]'s shape, indexed again


@through_patch_range("dtensor-spec-aliasing", "DTensor select on a dim it is not sharded on")
def test_indexing_leaves_the_dtensor_alone(tmp_path):
    for out in ranks_result(RANKS, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=180):
        assert out.pop("status") == ("applied" if patch_applies_here("dtensor-spec-aliasing") else None), out
        assert out == {"replicated": "as the plain tensor", "sharded": "as the plain tensor"}, out
