"""fsdp2-cpu: FSDP2 (``fully_shard``) on CPU with gloo on torch 2.4.

Without torchpatch (or with the patch turned off) the first forward of a ``fully_shard`` model on a
machine without CUDA dies creating FSDP2's ``torch.cuda.Stream``. With it, on 2 real ranks, a small
MLP of ``nn.Linear`` layers sharded per layer and at the root with ``reshard_after_forward=True`` (so
every backward all-gathers the parameters again) trains for 3 AdamW steps in float64, in float32 and
in float32 with HSDP (float32 gradients FSDP2 reduces with AVG, which 2.4's gloo does not do): the
losses, the first step's gradients and the final full parameters equal the same model trained on one
process with the full batch (float64 to 1e-12). The copy-out that FSDP2's collectives see keeps the
version counters of CPU tensors, and with torch's own copy-out back in its place the re-all-gathering
backward fails as the patch's docstring says. On torch 2.9 and 2.15 (FSDP2 runs on CPU natively) the
same training gives the same results with the patch not armed.
"""

import pytest

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, patch_applies_here, ranks_result, run_json,
    through_patch_range, where_patch_applies
)

NATIVE = """
import json, traceback, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed._composable.fsdp import fully_shard
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
fully_shard(model)
try:
    model(torch.randn(3, 4)).sum().backward()
    error = None
except (RuntimeError, AssertionError) as exc:
    frames = [f"{f.filename.rsplit('/', 1)[-1]}:{f.line}" for f in traceback.extract_tb(exc.__traceback__)]
    error = {"type": type(exc).__name__, "message": str(exc).splitlines()[0], "frames": frames}
import torchpatch
print(json.dumps({"cuda": torch.cuda.is_available(), "error": error, "status": torchpatch.status().get("fsdp2-cpu")}))
"""

# What torch.cuda.Stream() says where CUDA cannot run: a CUDA build without a driver, with a driver
# older than its runtime, or a CPU-only build.
NO_CUDA = ("Found no NVIDIA driver", "CUDA driver version is insufficient", "Torch not compiled with CUDA enabled")


@where_patch_applies("fsdp2-cpu", "torch 2.4's FSDP2 creates CUDA streams unconditionally")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_FSDP2_CPU": "0"}], ids=["unset", "opted-out"])
def test_native_failure(env):
    out = run_json(NATIVE, env=clean_env(**env))
    if out["cuda"]:
        pytest.skip("CUDA is available here: FSDP2 runs on it")
    error = out["error"]
    assert error is not None and out["status"] is None, out
    assert any(text in error["message"] for text in NO_CUDA), error
    frame = "_fsdp_param_group.py:self.all_gather_copy_in_stream = torch.cuda.Stream(priority=high_priority)"
    assert frame in error["frames"], error


# Every rank builds the same float64/float32 MLP and trains it on one process with the full batch
# first; then FSDP2 trains a copy on 2 ranks, each rank on its half of the batch (the mean of the two
# half-batch MSE losses is the full-batch loss, and FSDP2 averages the gradients). The first step's
# gradients are compared as well as the losses and final parameters: AdamW barely notices gradients
# off by a constant factor (2.4's gloo reduce-scatter sums where it is asked to average).
TRAIN = """
import copy, datetime, json, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed._composable.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
STEPS = 3

def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()

def train(model, x, y, average):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for _ in range(STEPS):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        grads = grads or [full(p.grad) for p in model.parameters()]  # the first step's
        opt.step()
        opt.zero_grad()
        losses.append(average(loss.detach()))
    return losses, grads

def rel_diff(a, b):
    return float(((a - b).abs() / b.abs().clamp_min(1e-3)).max())

def mean_over_ranks(loss):
    loss = loss.clone()
    dist.all_reduce(loss)
    return (loss / world).item()

def run(dtype, mesh):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)
    x, y = torch.randn(8, 8, dtype=dtype), torch.randn(8, 4, dtype=dtype)
    ref = copy.deepcopy(base)
    ref_losses, ref_grads = train(ref, x, y, lambda loss: loss.item())
    model = copy.deepcopy(base)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    losses, grads = train(model, x.chunk(world)[rank], y.chunk(world)[rank], mean_over_ranks)
    params = {}
    for (name, p), q, g, ref_g in zip(model.named_parameters(), ref.parameters(), grads, ref_grads):
        params[name] = [type(p).__name__, list(p.to_local().shape), rel_diff(p.full_tensor(), q), rel_diff(g, ref_g)]
    return {"losses": losses, "ref_losses": ref_losses, "params": params}

hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))  # all-reduce, not reduce-scatter
out = {"float64": run(torch.float64, mesh), "float32": run(torch.float32, mesh), "hsdp-float32": run(torch.float32, hsdp)}
import torchpatch
out["status"] = torchpatch.status().get("fsdp2-cpu")
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@through_patch_range("fsdp2-cpu", "FSDP2 (torch.distributed._composable.fsdp) came with torch 2.4")
def test_trains_as_one_process(tmp_path):
    for out in ranks_result(TRAIN, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=180):
        assert out["status"] == ("applied" if patch_applies_here("fsdp2-cpu") else None)
        for key, rel, tol in (("float64", 1e-12, 1e-12), ("float32", 1e-5, 1e-4), ("hsdp-float32", 1e-5, 1e-4)):
            run = out[key]
            assert run["losses"] == pytest.approx(run["ref_losses"], rel=rel, abs=0), (key, run)
            assert run["ref_losses"][0] > run["ref_losses"][1] > run["ref_losses"][2]  # it trains
            assert sorted(run["params"]) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
            for name, (kind, local_shape, diff, grad_diff) in run["params"].items():
                # the first step's gradients too: AdamW would hide gradients off by a constant factor
                assert kind == "DTensor" and diff < tol and grad_diff < tol, (key, name, kind, diff, grad_diff)
            # sharded on dim 0 over the 2 ranks; HSDP shards over 1 rank and replicates over 2
            assert run["params"]["2.weight"][1] == ([16, 16] if key.startswith("hsdp") else [8, 16])


# The version-counter part on its own: FSDP2's collectives module copies the all-gathered parameters
# out with ``split_with_sizes_copy(..., out=)``; the backward of a layer resharded after forward
# all-gathers again into the tensors autograd saved in forward. The copy FSDP2 sees leaves their
# version counters alone (torch's own bumps them on CPU); with torch's own put back for that module,
# the re-all-gathering backward fails and a backward without resharding does not.
VERSIONS = """
import datetime, json, torch, torch.distributed as dist, torch.nn as nn
import torch.distributed._composable.fsdp._fsdp_collectives as collectives
from torch.distributed._composable.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
out = {"fsdp_sees_torch": collectives.torch is torch}

def versions(split_with_sizes_copy):
    source = torch.arange(16.0, dtype=torch.float64).reshape(2, 8)
    outs = [torch.empty(2, 3, dtype=torch.float64), torch.empty(2, 5, dtype=torch.float64)]
    before = [t._version for t in outs]
    split_with_sizes_copy(source, [3, 5], dim=1, out=outs)
    return [t._version - v for t, v in zip(outs, before)], torch.equal(torch.cat(outs, 1), source)

out["fsdp_copy"] = versions(collectives.torch.split_with_sizes_copy)
out["torch_copy"] = versions(torch.split_with_sizes_copy)
collectives.torch.split_with_sizes_copy = torch.split_with_sizes_copy  # torch's own copy-out, for FSDP2 only

def step(reshard):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    fully_shard(model[0], mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model[2], mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    try:
        model(torch.randn(4, 4, dtype=torch.float64)).sum().backward()
        return "ok"
    except RuntimeError as exc:
        return str(exc).splitlines()[0]

out["no_reshard"] = step(False)
out["reshard"] = step(True)
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@where_patch_applies("fsdp2-cpu", "torch >= 2.6 keeps the version counters itself")
def test_copy_out_keeps_version_counters(tmp_path):
    for out in ranks_result(VERSIONS, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=180):
        assert out["fsdp_sees_torch"] is False
        assert out["fsdp_copy"] == [[0, 0], True]
        assert out["torch_copy"] == [[1, 1], True]  # pytorch#132014: the CPU kernel bumps them
        assert out["no_reshard"] == "ok"
        assert out["reshard"].startswith(
            "one of the variables needed for gradient computation has been modified by an inplace operation"), out
