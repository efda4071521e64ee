"""checkpoint-modules: ``torch.distributed.checkpoint`` under its 1.13 path; on 2.1 the
state_dict / stateful modules and dcp.save/load, checked by a 2-rank save/load round trip whose
resumed training equals an uninterrupted run, and against torch's own implementation on >= 2.2."""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, free_port, only_torch, rank_result, run_json, run_ranks,
    where_patch_does_not_apply
)

NATIVE = """
import json, torch, torch.distributed
out = {}
for name, stmt in [
    ("dcp", "import torch.distributed.checkpoint as dcp"),
    ("state_dict", "from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions"),
    ("stateful", "from torch.distributed.checkpoint.stateful import Stateful"),
    ("save", "import torch.distributed.checkpoint as dcp; dcp.save"),
    ("load", "from torch.distributed.checkpoint import load"),
]:
    try:
        exec(stmt, {})
        out[name] = None
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@only_torch("<2.0", "torch 1.13 keeps distributed checkpointing at torch.distributed._shard.checkpoint")
def test_native_failure_on_113():
    out = run_json(NATIVE)
    assert out["dcp"] == "ModuleNotFoundError: No module named 'torch.distributed.checkpoint'"


@only_torch(">=2.0,<2.2", "torch 2.2 added state_dict, stateful and save/load")
def test_native_failures_on_21():
    out = run_json(NATIVE)
    assert out["dcp"] is None
    assert out["state_dict"] == "ModuleNotFoundError: No module named 'torch.distributed.checkpoint.state_dict'"
    assert out["stateful"] == "ModuleNotFoundError: No module named 'torch.distributed.checkpoint.stateful'"
    assert out["save"] == "AttributeError: module 'torch.distributed.checkpoint' has no attribute 'save'"
    assert out["load"].startswith("ImportError: cannot import name 'load' from 'torch.distributed.checkpoint'")


@only_torch("<2.0")
def test_alias_on_113_is_the_shard_package():
    out = run_json(
        """
        import json, tempfile, warnings, torch, torch.nn as nn, torchpatch
        import torch.distributed.checkpoint as dcp
        import torch.distributed._shard.checkpoint as old
        import torch.distributed.checkpoint.filesystem as fs, torch.distributed.checkpoint.planner as planner
        from torch.distributed.checkpoint.metadata import Metadata
        from torch.distributed.checkpoint import FileSystemWriter, FileSystemReader
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
        from torch.distributed.checkpoint.stateful import Stateful

        # The aliased package works: a single-process save_state_dict / load_state_dict round trip.
        torch.manual_seed(0)
        model, fresh = nn.Linear(3, 2), nn.Linear(3, 2)
        path = tempfile.mkdtemp()
        dcp.save_state_dict(get_model_state_dict(model), FileSystemWriter(path), no_dist=True)
        target = get_model_state_dict(fresh)
        dcp.load_state_dict(target, FileSystemReader(path), no_dist=True)
        set_model_state_dict(fresh, target)
        print(json.dumps({
            "same": [dcp is old, fs is old.filesystem, planner is old.planner,
                     Metadata is old.metadata.Metadata, FileSystemWriter is old.FileSystemWriter],
            "name": dcp.__name__, "keys": sorted(get_model_state_dict(model)),
            "round_trip": all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values())),
            "stateful": isinstance(model, Stateful), "save": hasattr(dcp, "save"),
            "status": torchpatch.status().get("checkpoint-modules"),
        }))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out["same"] == [True] * 5 and out["name"] == "torch.distributed._shard.checkpoint"
    assert out["keys"] == ["bias", "weight"] and out["round_trip"] and out["stateful"]
    assert out["save"] is False  # 1.13's planners cannot flatten nested state dicts: no dcp.save there
    assert out["status"] == "applied"


# Two ranks: DDP model + AdamW after one step, saved through a Stateful app state like
# torchtitan's; an uninterrupted run takes a second step. A freshly built model/optimizer loads
# the checkpoint, must hold exactly the saved tensors, and its second step must equal the
# uninterrupted one.
ROUND_TRIP = """
import copy, datetime, json, sys, warnings, torch, torch.distributed as dist, torch.nn as nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel as DDP
warnings.simplefilter("ignore")
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
path = sys.argv[1]

class AppState(Stateful):
    def __init__(self, model, optim):
        self.model, self.optim = model, optim
    def state_dict(self):
        return {"model": get_model_state_dict(self.model),
                "optim": get_optimizer_state_dict(self.model, self.optim,
                                                  options=StateDictOptions(flatten_optimizer_state_dict=True))}
    def load_state_dict(self, sd):
        set_model_state_dict(self.model, sd["model"])
        set_optimizer_state_dict(self.model, self.optim, sd["optim"],
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))

def build(seed):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    model = DDP(net)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)

def step(model, optim, seed):
    g = torch.Generator().manual_seed(seed + rank)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()

def snapshot(model, optim):
    tensors = {("model", k): v.detach().clone() for k, v in model.module.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        for k, v in optim.state[p].items():
            tensors[("optim", i, k)] = v.clone()
    return tensors

model, optim = build(0)
step(model, optim, 100)
saved = snapshot(model, optim)
meta = dcp.save({"app": AppState(model, optim), "progress": {"step": 1}}, checkpoint_id=path)
ref_loss = step(model, optim, 200)
reference = snapshot(model, optim)

model2, optim2 = build(1)  # other weights, no optimizer state yet
differs = any(not torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
state = {"app": AppState(model2, optim2), "progress": {"step": 0}}
dcp.load(state, checkpoint_id=path)
loaded = snapshot(model2, optim2)
restored = sorted(loaded) == sorted(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)
loss = step(model2, optim2, 200)
resumed = snapshot(model2, optim2)
same_step = all(torch.equal(resumed[k], reference[k]) for k in reference)
# full_state_dict + cpu_offload: rank 0 alone gets the state; broadcast_from_rank0 hands it to all.
full = StateDictOptions(full_state_dict=True, cpu_offload=True)
msd, osd = get_model_state_dict(model2, options=full), get_optimizer_state_dict(model2, optim2, options=full)
model3, optim3 = build(2)
bcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
set_model_state_dict(model3, msd, options=bcast)
set_optimizer_state_dict(model3, optim3, osd, options=bcast)
third = snapshot(model3, optim3)
broadcast = all(torch.equal(third[k], resumed[k]) for k in resumed)
mine = {"restored": restored, "empty_off_rank0": (msd == {} and osd == {}) == (rank != 0), "broadcast": broadcast, "differs_before": differs, "progress": state["progress"],
        "same_step": same_step, "loss": loss, "ref_loss": ref_loss, "n": len(saved),
        "keys": sorted(k for k in meta.state_dict_metadata if k.startswith("app.model")),
        "save": dcp.save.__module__}
out = [None, None]
dist.all_gather_object(out, mine)
if rank == 0:
    print(RESULT + json.dumps(out), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@only_torch(">=2.0,<2.2")
def test_two_rank_save_load_resumes_identically(tmp_path):
    script = ROUND_TRIP.replace("sys.argv[1]", repr(str(tmp_path / "ckpt")))
    proc = run_ranks(script, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in rank_result(proc):
        assert r["save"] == "torchpatch.patches.checkpoint.checkpoint_modules"
        assert r["differs_before"] and r["restored"] and r["n"] == 4 + 4 * 3  # 4 params + step/exp_avg/exp_avg_sq
        assert r["progress"] == {"step": 1}
        assert r["same_step"] and r["loss"] == r["ref_loss"]
        assert r["empty_off_rank0"] and r["broadcast"]
        assert r["keys"] == ["app.model.0.bias", "app.model.0.weight", "app.model.2.bias", "app.model.2.weight"]


# One process: the options, compared against the same calls made through torch's own
# implementation where it exists (>= 2.2) or checked for their defined effect (2.1).
OPTIONS = """
import json, os, sys, warnings, torch, torch.nn as nn, torch.distributed as dist
warnings.simplefilter("ignore")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from types import ModuleType
from torch.nn.parallel import DistributedDataParallel as DDP
from torchpatch.patches.checkpoint import checkpoint_modules
shim = ModuleType("shim")
checkpoint_modules.build_state_dict(shim)

def make():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    net[0].bias.requires_grad_(False)
    model = DDP(net)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt

def describe(obj):
    if isinstance(obj, torch.Tensor):
        return ["tensor", obj.dtype.__repr__(), obj.device.type, obj.tolist()]
    if isinstance(obj, dict):
        return {str(k): describe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [describe(v) for v in obj]
    return obj

def run(api):
    model, opt = make()
    O = api.StateDictOptions
    out = {}
    out["plain"] = describe(api.get_state_dict(model, opt))
    out["frozen"] = sorted(api.get_model_state_dict(model, options=O(ignore_frozen_params=True)))
    out["full_cpu"] = describe(api.get_model_state_dict(model, options=O(full_state_dict=True, cpu_offload=True)))
    flat = api.get_optimizer_state_dict(model, opt, options=O(flatten_optimizer_state_dict=True))
    out["flat"] = describe(flat)
    model2, opt2 = make()
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)
    sd = api.get_model_state_dict(model)
    sd.pop("2.bias")
    try:
        api.set_model_state_dict(model2, dict(sd))
        out["strict"] = None
    except RuntimeError as exc:
        out["strict"] = "Missing key" in str(exc) or "Missing key(s)" in str(exc)
    res = api.set_model_state_dict(model2, sd, options=O(strict=False))
    out["non_strict"] = [list(res.missing_keys), list(res.unexpected_keys)]
    api.set_optimizer_state_dict(model2, opt2, flat, options=O(flatten_optimizer_state_dict=True))
    out["after_set"] = describe(api.get_state_dict(model2, opt2))
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    wrapped = torch.compile(nn.Sequential(nn.Linear(2, 2), checkpoint_wrapper(nn.Linear(2, 3))))
    wrapped_sd = api.get_model_state_dict(wrapped)
    out["wrapped"] = [sorted(wrapped_sd), str(api.set_model_state_dict(wrapped, wrapped_sd))]
    try:
        api.get_model_state_dict(model, options=O(broadcast_from_rank0=True))
    except ValueError as exc:
        out["bcast_needs_full"] = str(exc)
    return out

import torch.distributed.checkpoint.state_dict as imported
result = {"shim": run(shim), "served_by": getattr(imported, "__torchpatch__", None)}
if result["served_by"] is None:
    result["native_file"] = imported.__file__
    result["native"] = run(imported)
else:  # 2.1: the served module is the shim; sharded parameters raise a clear error
    result["served_is_shim"] = all(getattr(imported, n) is getattr(shim, n) for n in shim.__all__)
    from torch.distributed._tensor import DeviceMesh, Replicate, distribute_tensor
    net = nn.Linear(2, 2)
    net.weight = nn.Parameter(distribute_tensor(net.weight.detach(), DeviceMesh("cpu", [0]), [Replicate()]))
    try:
        shim.get_model_state_dict(net)
    except NotImplementedError as exc:
        result["dtensor"] = str(exc)
print(json.dumps(result))
dist.destroy_process_group()
"""


def _options():
    return run_json(OPTIONS, env=clean_env(TORCHPATCH="1"), args=(str(free_port()),))


@only_torch(">=2.0,<2.2")
def test_options_on_21():
    out = _options()
    shim = out["shim"]
    model_sd, optim_sd = shim["plain"]
    assert sorted(model_sd) == ["0.bias", "0.weight", "2.bias", "2.weight"]  # no DDP "module." prefix
    assert sorted(optim_sd["state"]) == ["0.weight", "2.bias", "2.weight"]  # frozen 0.bias has none
    assert optim_sd["param_groups"][0]["params"] == ["0.weight", "2.weight", "2.bias"]
    assert shim["frozen"] == ["0.weight", "2.bias", "2.weight"]
    assert shim["full_cpu"] == model_sd  # one rank: the whole state, on CPU
    assert "state.0.weight.exp_avg" in shim["flat"] and shim["flat"]["param_groups.2.bias.lr"] == 0.1
    assert shim["strict"] is True and shim["non_strict"] == [["module.2.bias"], []]
    assert shim["after_set"][1] == optim_sd  # flattened optimizer state loads back exactly
    assert shim["after_set"][0]["2.bias"] != model_sd["2.bias"]  # the key left out stayed as it was
    assert shim["bcast_needs_full"] == "full_state_dict must be True when broadcast_from_rank0 is True."
    # torch.compile's _orig_mod. prefix is not part of the FQN either
    assert shim["wrapped"] == [["0.bias", "0.weight", "1.bias", "1.weight"], "<All keys matched successfully>"]
    assert "DTensor" in out["dtensor"] and "torch >= 2.2" in out["dtensor"]
    assert out["served_by"] == "checkpoint-modules" and out["served_is_shim"]


@only_torch(">=2.9", "the reference: torch's own state_dict module (2.4's raises KeyError for a key "
                    "missing from a DDP model's state_dict even with strict=False; the shim follows 2.9+)")
def test_shim_matches_native_state_dict():
    out = _options()
    assert out["native_file"].endswith("torch/distributed/checkpoint/state_dict.py")
    shim, native = out["shim"], out["native"]
    for key in ("plain", "frozen", "full_cpu", "flat", "non_strict", "after_set", "wrapped", "bcast_needs_full"):
        assert shim[key] == native[key], key
    assert shim["strict"] is True and native["strict"] is True


@where_patch_does_not_apply("checkpoint-modules", "torch has the modules and save/load: the patch serves nothing")
def test_inactive_where_torch_has_it():
    out = run_json(
        """
        import json, torch, torchpatch
        import torch.distributed.checkpoint as dcp
        import torch.distributed.checkpoint.state_dict as sd, torch.distributed.checkpoint.stateful as st
        print(json.dumps({"files": [m.__file__ for m in (dcp, sd, st)],
                          "served": [getattr(m, "__torchpatch__", None) for m in (dcp, sd, st)],
                          "save": dcp.save.__module__, "load": dcp.load.__module__,
                          "status": torchpatch.status().get("checkpoint-modules")}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert [f.split("torch/distributed/")[1] for f in out["files"]] == [
        "checkpoint/__init__.py", "checkpoint/state_dict.py", "checkpoint/stateful.py"]
    assert out["served"] == [None] * 3 and out["status"] is None
    assert out["save"] == "torch.distributed.checkpoint.state_dict_saver"
    assert out["load"] == "torch.distributed.checkpoint.state_dict_loader"
