"""fsdp-share-comm-ctx: ``torch.distributed.fsdp.share_comm_ctx`` on torch 2.4-2.9.

Without torchpatch the import fails. With it (and natively from 2.10) the same 2-rank gloo script
runs two FSDP roots, as a pipeline rank holds its model chunks, one after the other, after
``share_comm_ctx([chunk0, chunk1])``: every FSDP state and parameter group of both trees then holds the
first root's communication context, and outputs and gradients equal the same model's on one process;
an empty list does nothing and a module that is not an FSDPModule raises torch's ``ValueError``.
"""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, patch_applies_here, ranks_result, run_json,
    run_py, through_patch_range, where_patch_applies
)


@where_patch_applies("fsdp-share-comm-ctx", "torch 2.4-2.9 have FSDP2 without it")
def test_native_import_error():
    proc = run_py("from torch.distributed.fsdp import share_comm_ctx")
    assert "ImportError: cannot import name 'share_comm_ctx' from 'torch.distributed.fsdp'" in proc.stderr, \
        proc.stderr[-2000:]


SCRIPT = """
import copy, datetime, json, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard, share_comm_ctx
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
chunks = [nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8)), nn.Sequential(nn.Tanh(), nn.Linear(8, 3))]
x = torch.randn(4, 6)
ref = copy.deepcopy(chunks)
ref_out = ref[1](ref[0](x))
ref_out.sum().backward()

mesh = init_device_mesh("cpu", (world,))
fully_shard(chunks[0][0], mesh=mesh)
for chunk in chunks:
    fully_shard(chunk, mesh=mesh)
out = {"empty": share_comm_ctx([]) is None}
try:
    share_comm_ctx([chunks[0], nn.Linear(2, 2)])
except ValueError as exc:
    out["not_fsdp"] = str(exc).split(" but got")[0]
share_comm_ctx(chunks)

y = chunks[1](chunks[0](x))
y.sum().backward()
out["forward"] = float((y - ref_out).abs().max())
grads = [p.grad.full_tensor() for chunk in chunks for p in chunk.parameters()]
out["grads"] = max(float((g - q.grad).abs().max()) for g, q in zip(grads, [q for c in ref for q in c.parameters()]))
states = [m._get_fsdp_state() for chunk in chunks for m in chunk.modules() if isinstance(m, FSDPModule)]
groups = [s._fsdp_param_group for s in states if s._fsdp_param_group is not None]
shared = states[0]._comm_ctx
out["states"] = len(states)
out["shared"] = [s._comm_ctx is shared for s in states] + [g.comm_ctx is shared for g in groups]
import torchpatch
out["status"] = torchpatch.status().get("fsdp-share-comm-ctx")
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@through_patch_range("fsdp-share-comm-ctx", "FSDP2 came with torch 2.4")
def test_roots_share_one_context_on_two_ranks(tmp_path):
    for out in ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=180):
        assert out["empty"] is True and out["not_fsdp"] == "Expects list of FSDPModules"
        assert out["states"] == 3 and out["shared"] == [True] * 6, out
        assert out["forward"] < 1e-12 and out["grads"] < 1e-12, out
        assert out["status"] == ("applied" if patch_applies_here("fsdp-share-comm-ctx") else None)


@only_torch(">=2.10", "torch has it: nothing is served")
def test_inactive_where_torch_has_it():
    out = run_json("""
        import json, torchpatch
        from torch.distributed.fsdp import share_comm_ctx
        print(json.dumps({"module": share_comm_ctx.__module__, "status": torchpatch.status().get("fsdp-share-comm-ctx")}))
        """, env=clean_env(TORCHPATCH="1"))
    assert out == {"module": "torch.distributed.fsdp", "status": None}
