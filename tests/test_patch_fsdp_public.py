"""fsdp-public: FSDP2's public names in ``torch.distributed.fsdp`` on torch 2.4 (and 2.5).

Without torchpatch (or with the patch turned off) torch 2.4's ``torch.distributed.fsdp`` has none of
them: ``from torch.distributed.fsdp import CPUOffloadPolicy`` raises the ``ImportError`` of the
patch's docstring. With it every name is the very object of ``torch.distributed._composable.fsdp``
(and FSDP1's names are untouched). On 2 real ranks (gloo) code written for torch >= 2.6 runs with the
public names only: ``fully_shard`` with a ``MixedPrecisionPolicy`` and an ``OffloadPolicy``, an
``FSDPModule`` whose ``unshard(async_op=True)`` gives an ``UnshardHandle``, a method registered with
``register_fsdp_forward_method``; its forward and gradients equal the same model's on one process. On
torch 2.9 and 2.15 the same code runs on torch's own names and the patch is not armed.
"""

import pytest

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, patch_applies_here, ranks_result, run_json,
    through_patch_range, where_patch_applies
)

PUBLIC = ["fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
          "register_fsdp_forward_method", "UnshardHandle"]

NAMES = """
import importlib, json, torch.distributed.fsdp as public
PUBLIC = %r
private = importlib.import_module("torch.distributed._composable.fsdp")
submodule = importlib.import_module("torch.distributed._composable.fsdp.fully_shard")
try:
    from torch.distributed.fsdp import CPUOffloadPolicy
    error = None
except ImportError as exc:
    error = str(exc)
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy  # FSDP1, always there
out = {"error": error,
       "has": [hasattr(public, n) for n in PUBLIC],
       "same": [getattr(public, n, None) is getattr(private if hasattr(private, n) else submodule, n) for n in PUBLIC],
       "fsdp1": FullyShardedDataParallel.__module__}
import torchpatch
out["status"] = torchpatch.status().get("fsdp-public")
print(json.dumps(out))
""" % (PUBLIC,)


@where_patch_applies("fsdp-public", "FSDP2 is private only (torch.distributed._composable.fsdp) on torch 2.4 and 2.5")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_FSDP_PUBLIC": "0"}], ids=["unset", "opted-out"])
def test_native_failure(env):
    out = run_json(NAMES, env=clean_env(**env))
    assert out["error"].startswith("cannot import name 'CPUOffloadPolicy' from 'torch.distributed.fsdp'"), out
    assert out["has"] == [False] * len(PUBLIC) and out["status"] is None


@through_patch_range("fsdp-public", "FSDP2 came with torch 2.4")
def test_public_names_are_the_private_objects():
    out = run_json(NAMES, env=clean_env(TORCHPATCH="1"))
    assert out["error"] is None
    assert out["has"] == [True] * len(PUBLIC) and out["same"] == [True] * len(PUBLIC), out
    assert out["fsdp1"] == "torch.distributed.fsdp.fully_sharded_data_parallel"
    assert out["status"] == ("applied" if patch_applies_here("fsdp-public") else None)


SCRIPT = """
import copy, datetime, json, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, UnshardHandle, fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_default_dtype(torch.float64)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(6, 8), nn.Linear(8, 3)
    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))
    def encode(self, x):  # not forward: FSDP2 unshards for it only once registered
        return torch.tanh(self.inp(x))

torch.manual_seed(0)
base, x = Net(), torch.randn(4, 6)
ref = copy.deepcopy(base)
ref_out = ref(x)
ref_out.sum().backward()

model = copy.deepcopy(base)
mesh = init_device_mesh("cpu", (world,))
policy = MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float64)
fully_shard(model.inp, mesh=mesh, mp_policy=policy, offload_policy=OffloadPolicy())
fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
register_fsdp_forward_method(model, "encode")
out = {"is_fsdp_module": [isinstance(model, FSDPModule), isinstance(model.inp, FSDPModule), isinstance(model.out, FSDPModule)],
       "cpu_offload_policy": isinstance(CPUOffloadPolicy(), OffloadPolicy)}
y = model(x)
out["forward"] = float((y - ref_out).abs().max())
y.sum().backward()
out["grads"] = max(float((p.grad.full_tensor() - q.grad).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
# (torch 2.4's unshard() needs the communication state the first forward sets up)
handle = model.unshard(async_op=True)
out["unshard_handle"] = isinstance(handle, UnshardHandle)
handle.wait()
out["unsharded"] = [hasattr(p, "full_tensor") for p in model.parameters()]  # DTensor: sharded
model.reshard()
out["resharded"] = [hasattr(p, "full_tensor") for p in model.parameters()]
out["encode"] = float((model.encode(x) - torch.tanh(ref.inp(x))).abs().max())
import torchpatch
out["status"] = torchpatch.status().get("fsdp-public")
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@through_patch_range("fsdp-public", "FSDP2 came with torch 2.4")
def test_public_api_on_two_ranks(tmp_path):
    for out in ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=180):
        assert out["is_fsdp_module"] == [True, True, False]
        assert out["cpu_offload_policy"] is True and out["unshard_handle"] is True
        # the root's unshard() gathers its own group (model.out's parameters), not model.inp's
        assert out["unsharded"] == [True, True, False, False] and out["resharded"] == [True] * 4, out
        assert out["forward"] < 1e-12 and out["grads"] < 1e-12 and out["encode"] < 1e-12, out
        assert out["status"] == ("applied" if patch_applies_here("fsdp-public") else None)
