"""DTensor's hot path with TORCHPATCH=1: how many Python calls into torchpatch an op and a
tensor-parallel training step make, counted with ``sys.setprofile`` on 2 real ranks (gloo).

Counts, not times: deterministic on a busy machine. The times (ratios of alternated runs) are
``benchmarks/dtensor_hot_path.py``'s. An op with a sharding strategy makes no call at all: the
DTensor patches act where torch decides (strategy registration, sharding-cache misses, the read of
torch's implicit-replication switch for a plain tensor), never around every op.
"""

import pytest

from conftest import LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, rank_result, run_ranks, torch_matches

SCRIPT = """
import json, sys, torch, torch.distributed as dist
from pathlib import Path
dist.init_process_group("gloo")
import torchpatch
from torch.distributed._tensor import Replicate, Shard, distribute_tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
a, b = (distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]) for _ in range(2))
w = distribute_tensor(torch.randn(4, 6), mesh, [Replicate()])
model = parallelize_module(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
                           mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(3, 4)

def step():
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()

calls = {
    "add": lambda: a + b, "sum": lambda: a.sum(), "mul_number": lambda: a * 2.0, "matmul": lambda: a @ w,
    "redistribute": lambda: a.redistribute(mesh, [Replicate()]).to_local() + 0, "tp_step": step,
}
root = str(Path(torchpatch.__file__).resolve().parent)
out = {}
for name, fn in calls.items():
    fn(); fn()  # sharding caches filled
    seen = []
    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            seen.append(frame.f_code.co_filename[len(root) + 1:] + ":" + frame.f_code.co_name)
    sys.setprofile(profile)
    fn()
    sys.setprofile(None)
    out[name] = seen
out["applied"] = sorted(k for k, v in torchpatch.status().items() if v == "applied")
if dist.get_rank() == 0:
    print(RESULT + json.dumps(out), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    return rank_result(run_ranks(SCRIPT, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path_factory.mktemp("hot")))


@only_torch(">=2.4", "the DTensor patches of the hot path (2.2-2.3: the same code, untested here)")
@pytest.mark.parametrize("op", ["add", "sum", "mul_number", "matmul"])
def test_an_op_makes_no_call_into_torchpatch(counted, op):
    assert "dtensor-implicit-replication" in counted["applied"] and "dtensor-op-fallback" in counted["applied"]
    assert counted[op] == []


# What a tensor-parallel step may call, per torch: hooks where an op's inputs move (2.4-2.8), where a
# collective runs (funcol-autograd's Autograd kernels, 2.4-2.12; gloo's missing AVG, 2.4) and C++
# dispatch's slow path (2.10+), each a few times a step; never a hook of every op.
STEP_HOOKS = {
    "patches/dtensor/dtensor_stale_scalar_args.py:_live_scalars": "<2.9",
    "patches/dtensor/dtensor_explicit_redistribution.py:observed": "<2.10",  # only where inputs move
    "patches/collectives/funcol_autograd.py:_connected_wrap": "<2.13",
    "patches/collectives/funcol_autograd.py:autograd_kernel": "<2.5",  # 2.4: the kernel that skips the Function without grad
    "patches/collectives/funcol_autograd.py:setup_context": "<2.5",
    "patches/collectives/funcol_autograd.py:_all_reduce_setup": "<2.5",
    "patches/collectives/gloo_avg.py:_all_reduce": "<2.5",
    "patches/dtensor/dtensor_op_fallback.py:_local_results": ">=2.10",
}


@only_torch(">=2.4")
def test_a_tensor_parallel_step_calls_only_hooks_off_the_per_op_path(counted):
    allowed = {name for name, spec in STEP_HOOKS.items() if torch_matches(spec)}
    assert set(counted["tp_step"]) <= allowed, counted["tp_step"]
    # 2.4 (the most): each of the step's two redistributions calls _live_scalars and observed, its one
    # all-reduce gloo_avg's and funcol-autograd's two hooks: 7 calls, none per op
    assert len(counted["tp_step"]) <= 7, counted["tp_step"]


@only_torch(">=2.4")
def test_a_redistribution_pays_only_for_differentiable_collectives(counted):
    """On 2.4-2.12 funcol-autograd gives the functional collectives an Autograd kernel (in Python):
    the wait's, and the output's AsyncCollectiveTensor; on 2.4 the collective's own (torch 2.4's
    ``register_autograd`` would run its Function even when nothing needs grad: the patch's kernel
    does not). Nothing else is on the way."""
    expected = {"patches/collectives/funcol_autograd.py:_wait_autograd", "patches/collectives/funcol_autograd.py:_connected_wrap"}
    if torch_matches("<2.5"):
        expected.add("patches/collectives/funcol_autograd.py:autograd_kernel")
    if torch_matches(">=2.13"):
        expected = set()
    assert set(counted["redistribute"]) <= expected, counted["redistribute"]
