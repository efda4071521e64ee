"""The trainer state that every torch of the matrix saves as a DCP checkpoint (``tests/fixtures/checkpoints/
<torch>``, written by ``tools/checkpoint_fixtures.py``), and the program that resumes it on another torch.

A trainer of tiny MLPs, each with its optimizer and LR scheduler: AdamW (fused where the torch has a CPU
fused AdamW, else foreach) with a warm-up LambdaLR, Adam (foreach) with torchtitan's warm-up/cosine chain
(SequentialLR of LinearLR and CosineAnnealingLR), SGD with momentum (plain, the for-loop kernel) with
StepLR, and where the state is saved with ``get_state_dict`` a second AdamW whose optimizer state is
flattened as torchtitan keeps it (``flatten_optimizer_state_dict=True``); and the loop's own state (step,
torch's RNG state, a data position). 3 steps on a fixed global batch. Savers with FSDP2 (torch 2.4+)
shard every model over 2 gloo ranks (``fully_shard`` on each Linear and the root) and save with
``get_state_dict`` + ``dcp.save``; torch 2.1 (no FSDP2, no ``get_state_dict``) saves the plain state
dicts of one process with ``save_state_dict``. Beside the checkpoint, rank 0 writes the same state with
``torch.save``, full tensors and plain state dicts (``expected.pt``), and ``manifest.json``.

The loader rebuilds the trainer on its own torch (one process, DCP resharding; or ranks, FSDP2 as
saved), loads the whole state with one ``dcp.load`` as a trainer resumes, then gives each part (model,
optimizer, scheduler, loop) to its ``load_state_dict`` and reports each; then the reference: the same
trainer loaded from ``expected.pt`` through the loader torch's own ``load_state_dict`` (what that torch
does with an older state dict), and one more training step of both, compared bit for bit: the model,
every optimizer state tensor, the param groups and each scheduler's learning rate.
"""

# argv: the output folder. Ranks (RANK/WORLD_SIZE set) where FSDP2 exists, else one process.
SAVE = r"""
import json, os, sys, warnings, torch, torch.nn as nn
warnings.simplefilter("ignore")
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.optim import lr_scheduler as L
out = sys.argv[1]
sharded = "RANK" in os.environ
if sharded:
    dist.init_process_group("gloo")
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
KINDS
torch.manual_seed(1)
X, Y = torch.randn(8, 8), torch.randn(8, 4)

def shard(model):
    if sharded:
        fully_shard(model[0]); fully_shard(model[2]); fully_shard(model)

trainer = build(shard, ("adamw", "adam", "sgd", "adamw_flat") if sharded else ("adamw", "adam", "sgd"))
part = slice(rank * 8 // world, (rank + 1) * 8 // world)
torch.manual_seed(123)
for step in range(1, 4):
    for model, opt, sched in trainer.values():
        nn.functional.mse_loss(model(X[part]), Y[part]).backward()
        opt.step(); opt.zero_grad(); sched.step()
    torch.rand(3)  # the loop draws from torch's generator
loop = {"step": 3, "rng": torch.get_rng_state(), "data": {"epoch": 0, "position": 24}}

def full(value):
    if isinstance(value, dict):
        return {k: full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [full(v) for v in value]
    return value.full_tensor() if hasattr(value, "full_tensor") else value

state, expected = {"loop": loop}, {"loop": loop}
for name, (model, opt, sched) in trainer.items():
    if sharded:
        model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flat(name)))
        full_model, full_optim = full(model_sd), full(get_state_dict(model, opt)[1])
    else:
        model_sd = full_model = model.state_dict()
        optim_sd = full_optim = opt.state_dict()
    state[name] = {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()}
    expected[name] = {"model": full_model, "optim": full_optim, "sched": sched.state_dict()}
if sharded:
    dcp.save(state, checkpoint_id=os.path.join(out, "dcp"))
else:
    dcp.save_state_dict(state, storage_writer=dcp.FileSystemWriter(os.path.join(out, "dcp")), no_dist=True)
if rank == 0:
    torch.save(expected, os.path.join(out, "expected.pt"))
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump({"torch": torch.__version__.split("+")[0], "ranks": world,
                   "optimizer_state": "fqn" if sharded else "param-ids", "adamw": ADAMW_IMPL,
                   "trainer": list(trainer)}, f, indent=1)
        f.write("\n")
"""

# The trainer's parts as both programs build them (before any checkpoint is loaded).
KINDS = r"""
def fused_adamw_on_cpu():
    try:
        torch.optim.AdamW([nn.Parameter(torch.zeros(1))], fused=True).step()
        return True
    except Exception:
        return False
ADAMW_IMPL = "fused" if fused_adamw_on_cpu() else "foreach"

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

def make_optimizer(name, model):
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, **{ADAMW_IMPL: True})
    if name == "adamw_flat":
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, foreach=True)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.05, foreach=True)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01, foreach=False)

def make_scheduler(name, opt):
    if name in ("adamw", "adamw_flat"):
        return L.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    if name == "adam":
        return L.SequentialLR(opt, [L.LinearLR(opt, 0.5, 1.0, 2), L.CosineAnnealingLR(opt, 6)], [2])
    return L.StepLR(opt, 2, 0.5)

def flat(name):  # its optimizer state as torchtitan keeps it: get_state_dict(flatten_optimizer_state_dict=True)
    return name == "adamw_flat"

def build(shard=lambda model: None, names=("adamw", "adam", "sgd")):
    trainer = {}
    for name in names:
        model = mlp()
        shard(model)
        opt = make_optimizer(name, model)
        trainer[name] = (model, opt, make_scheduler(name, opt))
    return trainer
"""

SAVE = SAVE.replace("KINDS", KINDS)

# argv: the fixture folder. Prints one JSON document: {"parts": {part: "ok" or the error}, "step":
# {what: "same" or how it differs}} (the step where every part loaded). One process, or ranks (each
# prints its own document, on its own shards).
LOAD = r"""
import copy, json, os, sys, warnings, torch, torch.nn as nn
warnings.simplefilter("ignore")
import torch.distributed.checkpoint as dcp
from torch.optim import lr_scheduler as L
folder = sys.argv[1]
with open(os.path.join(folder, "manifest.json")) as f:
    manifest = json.load(f)
KINDS
ADAMW_IMPL = manifest["adamw"] if manifest["adamw"] == "foreach" or fused_adamw_on_cpu() else "foreach"
fqn = manifest["optimizer_state"] == "fqn"
shard = lambda model: None
if "RANK" in os.environ:  # as ranks: each model sharded with FSDP2, as the savers did
    import torch.distributed as dist
    dist.init_process_group("gloo")
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard

    def shard(model):
        fully_shard(model[0]); fully_shard(model[2]); fully_shard(model)
if fqn:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)


def load(state):
    if hasattr(dcp, "load"):
        dcp.load(state, checkpoint_id=os.path.join(folder, "dcp"))
    else:
        dcp.load_state_dict(state, storage_reader=dcp.FileSystemReader(os.path.join(folder, "dcp")), no_dist=True)


def requested(objects):
    # what the trainer asks the checkpoint for: this torch's own state dicts of fresh objects
    state = {"loop": {"step": 0, "rng": torch.get_rng_state(), "data": {"epoch": -1, "position": -1}}}
    for name, (model, opt, sched) in objects.items():
        if fqn:
            options = StateDictOptions(flatten_optimizer_state_dict=flat(name))
            state[name] = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=options)}
        else:  # param-id optimizer state: a step on zero gradients makes the entries DCP fills
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            opt.step(); opt.zero_grad()
            state[name] = {"model": model.state_dict(), "optim": opt.state_dict()}
        state[name]["sched"] = sched.state_dict()
    return state


def apply(objects, state, part):
    if part == "loop":
        torch.set_rng_state(state["loop"]["rng"])
        loop.update(state["loop"])
        return
    for name, (model, opt, sched) in objects.items():
        if part == "sched":
            sched.load_state_dict(state[name]["sched"])
        elif part == "model":
            set_model_state_dict(model, state[name]["model"]) if fqn else model.load_state_dict(state[name]["model"])
        elif fqn:
            set_optimizer_state_dict(model, opt, state[name]["optim"],
                                     options=StateDictOptions(flatten_optimizer_state_dict=flat(name)))
        else:
            opt.load_state_dict(state[name]["optim"])


def error(exc):
    # DCP's CheckpointException (a BaseException) carries each rank's: the first
    exc = next((e for e, _ in getattr(exc, "failures", {}).values() if isinstance(e, BaseException)), exc)
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]


# one dcp.load of the whole trainer state, as a trainer resumes; then each part's load_state_dict
resumed, parts, loop = build(shard, manifest["trainer"]), {}, {}
state = requested(resumed)
try:
    load(state)
    parts["load"] = "ok"
except BaseException as exc:
    parts["load"] = error(exc)
else:
    for part in ("model", "optim", "sched", "loop"):
        try:
            apply(resumed, state, part)
            parts[part] = "ok"
        except BaseException as exc:
            parts[part] = error(exc)
resumed_rng = torch.get_rng_state()
result = {"torch": torch.__version__.split("+")[0], "saved_by": manifest["torch"], "parts": parts}

if all(v == "ok" for v in parts.values()):
    # the reference: the same trainer from torch.save's copy, through this torch's own load_state_dict
    expected = torch.load(os.path.join(folder, "expected.pt"))
    reference = build(shard, manifest["trainer"])
    for name, (model, opt, sched) in reference.items():
        if fqn:  # full tensors, sharded here as the ranks' own
            full = StateDictOptions(full_state_dict=True)
            set_model_state_dict(model, expected[name]["model"], options=full)
            set_optimizer_state_dict(model, opt, expected[name]["optim"], options=full)
        else:
            model.load_state_dict(expected[name]["model"])
            opt.load_state_dict(expected[name]["optim"])
        sched.load_state_dict(expected[name]["sched"])
    torch.manual_seed(7)
    X, Y = torch.randn(8, 8), torch.randn(8, 4)

    def tensors(name, objects):  # this process's values (its shards, where sharded)
        model, opt, sched = objects[name]
        local = lambda v: v.to_local() if hasattr(v, "to_local") else v
        out = {f"model.{k}": local(v) for k, v in model.state_dict().items()}
        for i, p in enumerate(model.parameters()):
            out.update({f"optim.{i}.{k}": local(v) for k, v in opt.state.get(p, {}).items() if torch.is_tensor(v)})
        return out

    def groups(opt):  # (a tuple as a list: torch's full-state-dict load gives betas as a list)
        return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"}
                for g in opt.param_groups]

    step = {"loop.rng": "same" if torch.equal(resumed_rng, expected["loop"]["rng"]) else "differs",
            "loop.state": "same" if (loop["step"], loop["data"]) == (expected["loop"]["step"], expected["loop"]["data"])
            else f"differs: {loop['step']}, {loop['data']}"}
    for name in resumed:
        for objects in (resumed, reference):
            model, opt, sched = objects[name]
            nn.functional.mse_loss(model(X), Y).backward()
            opt.step(); opt.zero_grad(); sched.step()
        a, b = tensors(name, resumed), tensors(name, reference)
        diff = [k for k in b if k not in a or not torch.equal(a[k], b[k])]
        step[f"{name}.tensors"] = "same" if not diff and len(a) == len(b) else f"differs: {diff[:4]}"
        # the entries of this torch's param groups (a newer torch's state dict, loaded with
        # load_state_dict, keeps entries this torch never reads: DCP loads only this torch's)
        mine, theirs = groups(resumed[name][1]), groups(reference[name][1])
        theirs = [{k: g.get(k) for k in m} for m, g in zip(mine, theirs)]
        step[f"{name}.param_groups"] = "same" if mine == theirs else f"differs: {mine} vs {theirs}"
        step[f"{name}.lr"] = ("same" if resumed[name][2].get_last_lr() == reference[name][2].get_last_lr()
                              else f"differs: {resumed[name][2].get_last_lr()} vs {reference[name][2].get_last_lr()}")
    result["step"] = step
print(json.dumps(result))
"""

LOAD = LOAD.replace("KINDS", KINDS)
