"""dtensor-random: ``torch.distributed.tensor._random.manual_seed`` on torch 2.1-2.4 with torch
2.13's semantics (a warning and nothing else on a CPU mesh, as torch 2.13 does; per-rank seeds
without a collective; an error for a rank outside the mesh), on 2 ranks."""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, free_port, only_torch, rank_result, run_json, run_ranks,
    torch_matches, where_patch_applies
)

NATIVE = """
import json, torch, torch.distributed.tensor as pkg
out = {}
try:
    pkg._random
except AttributeError as exc:
    out["attribute"] = str(exc)
try:
    import torch.distributed.tensor._random
except ImportError as exc:
    out["import"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@where_patch_applies("dtensor-random", "torch 2.5 moved the module to torch.distributed.tensor._random")
def test_native_failure():
    out = run_json(NATIVE)
    assert out == {"attribute": "module 'torch.distributed.tensor' has no attribute '_random'",
                   "import": "ModuleNotFoundError: No module named 'torch.distributed.tensor._random'"}


CPU_WARNINGS = ["DTensor random operators may not have complete support on cpu device mesh",
                "DTensor manual_seed() may not have complete support on cpu device mesh"]

# Two ranks. On the CPU mesh: torch 2.13's warnings and no tracker. On a CUDA-like device (faked:
# manual_seed only records seeds, it draws nothing) each rank seeds its own value, as pipeline
# stages do, without a collective; torch 2.1-2.4's own manual_seed rejects differing seeds.
RANKS = """
import datetime, json, types, warnings, torch, torch.distributed as dist, torchpatch
import torch.distributed.tensor as pkg
from torch.distributed._tensor import DeviceMesh
from torch.distributed._tensor import random as old
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
mesh, sub = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [0])
out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pkg._random.manual_seed(1234 + rank, mesh)  # reached as an attribute, as torchtitan does
out["cpu_warnings"] = [str(w.message) for w in caught]
out["no_tracker_on_cpu"] = old._rng_tracker is None
import torch.distributed.tensor._random as served
out["same_module"] = served is pkg._random and served.is_rng_supported_mesh is old.is_rng_supported_mesh
out["names"] = sorted(n for n in vars(served) if not n.startswith("__"))
try:
    old.manual_seed(1234, mesh)
    out["native_cpu"] = None
except Exception as exc:
    out["native_cpu"] = type(exc).__name__

torch.fakegpu = types.SimpleNamespace(is_available=lambda: True, current_device=lambda: 0, device_count=lambda: 1,
                                      get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state)
mesh.device_type = sub.device_type = "fakegpu"
seed = 100 + 7 * rank
served.manual_seed(seed, mesh)
out["tracker"] = [type(old._rng_tracker).__name__, old._rng_tracker.get_seed("parallel-rng") == seed]
out["torch_seed"] = torch.initial_seed() == seed
try:
    served.manual_seed(seed, sub)
    out["outside_mesh"] = None
except RuntimeError as exc:
    out["outside_mesh"] = str(exc)[:53]
old._rng_tracker = None
try:
    old.manual_seed(seed, mesh)
    out["native_differing_seeds"] = None
except RuntimeError as exc:
    out["native_differing_seeds"] = "different seed values" in str(exc)
out["status"] = torchpatch.status().get("dtensor-random")
gathered = [None, None]
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@where_patch_applies("dtensor-random")
def test_served_on_two_ranks(tmp_path):
    proc = run_ranks(RANKS, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = rank_result(proc)
    for r in (r0, r1):
        assert r["cpu_warnings"] == CPU_WARNINGS and r["no_tracker_on_cpu"] and r["same_module"]
        assert r["names"] == ["is_rng_supported_mesh", "manual_seed"]  # OffsetBasedRNGTracker changed: not served
        # torch's own manual_seed on a CPU mesh: 2.1 raises NotImplementedError ("only supports
        # cuda/cuda-like"), 2.4 gets further and fails on torch.cpu's missing get_rng_state.
        assert r["native_cpu"] == ("NotImplementedError" if torch_matches("<2.2") else "AttributeError")
        assert r["tracker"] == ["OffsetBasedRNGTracker", True] and r["torch_seed"]
        assert r["native_differing_seeds"] is True and r["status"] == "applied"
    assert r0["outside_mesh"] is None  # rank 0 is in the sub-mesh [0]
    assert r1["outside_mesh"] == "manual_seed requires the current rank to be a part of"


@only_torch(">=2.5", "torch's own module: on a CPU mesh it warns the same way, nothing is served")
def test_inactive_where_torch_has_it():
    out = run_json(
        """
        import json, os, sys, warnings, torch, torch.distributed as dist, torchpatch
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
        dist.init_process_group("gloo", rank=0, world_size=1)
        import torch.distributed.tensor as pkg
        from torch.distributed.device_mesh import DeviceMesh
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pkg._random.manual_seed(5, DeviceMesh("cpu", [0]))
        print(json.dumps({"warnings": [str(w.message) for w in caught], "file": pkg._random.__file__.split("torch/")[-1],
                          "status": torchpatch.status().get("dtensor-random")}))
        dist.destroy_process_group()
        """,
        env=clean_env(TORCHPATCH="1"),
        args=(str(free_port()),),
    )
    assert out == {"warnings": CPU_WARNINGS, "file": "distributed/tensor/_random.py", "status": None}
