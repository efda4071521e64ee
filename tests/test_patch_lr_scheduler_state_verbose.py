"""lr-scheduler-state-verbose: every LR scheduler's ``state_dict()`` has no ``verbose`` key, as on torch
2.15 (the same script run there: its key sets are the reference), while the scheduler keeps this torch's
behaviour; a DCP checkpoint of a scheduler that torch 2.15 saved loads here."""

import json

from conftest import (clean_env, run_json, run_newest_torch_json, through_patch_range, where_patch_applies,
                      where_patch_does_not_apply)

# Each scheduler class (nested ones of SequentialLR/ChainedScheduler as "_schedulers[i].key"): its
# state_dict's keys after 3 steps; with "verbose", its verbose attribute, printed lines and learning rates.
SCHEDULERS = """
import contextlib, io, json, sys, torch, torchpatch
from torch.optim import lr_scheduler as L
from torch.optim.swa_utils import SWALR

verbose = {"verbose": True} if "verbose" in sys.argv else {}

def opt():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)

def schedulers():
    yield "LambdaLR", L.LambdaLR(opt(), lambda s: 1 / (s + 1), **verbose)
    yield "MultiplicativeLR", L.MultiplicativeLR(opt(), lambda s: 0.9, **verbose)
    yield "StepLR", L.StepLR(opt(), 2, **verbose)
    yield "MultiStepLR", L.MultiStepLR(opt(), [2, 4], **verbose)
    yield "ConstantLR", L.ConstantLR(opt(), **verbose)
    yield "LinearLR", L.LinearLR(opt(), **verbose)
    yield "ExponentialLR", L.ExponentialLR(opt(), 0.9, **verbose)
    o = opt()
    yield "SequentialLR", L.SequentialLR(o, [L.ConstantLR(o, **verbose), L.ExponentialLR(o, 0.9, **verbose)], [2])
    yield "PolynomialLR", L.PolynomialLR(opt(), **verbose)
    yield "CosineAnnealingLR", L.CosineAnnealingLR(opt(), 10, **verbose)
    o = opt()
    yield "ChainedScheduler", L.ChainedScheduler([L.ConstantLR(o, **verbose), L.ExponentialLR(o, 0.9, **verbose)])
    yield "ReduceLROnPlateau", L.ReduceLROnPlateau(opt(), patience=0, **verbose)
    yield "CyclicLR", L.CyclicLR(opt(), 0.01, 0.1, step_size_up=2, **verbose)
    yield "CosineAnnealingWarmRestarts", L.CosineAnnealingWarmRestarts(opt(), 3, **verbose)
    yield "OneCycleLR", L.OneCycleLR(opt(), 0.1, total_steps=10, **verbose)
    yield "SWALR", SWALR(opt(), 0.05)  # takes no verbose; inherits LRScheduler.__init__'s default

def keys(state):
    return sorted(state) + [f"_schedulers[{i}].{key}" for i, inner in enumerate(state.get("_schedulers", ()))
                            for key in sorted(inner)]

out, printed = {}, io.StringIO()
with contextlib.redirect_stdout(printed):
    for name, sched in schedulers():
        lrs = []
        for _ in range(3):
            sched.optimizer.step()
            sched.step(1.0) if name == "ReduceLROnPlateau" else sched.step()
            lrs.append(sched.optimizer.param_groups[0]["lr"])
        out[name] = {"keys": keys(sched.state_dict()), "lrs": lrs, "verbose": getattr(sched, "verbose", None)}
print(json.dumps({"schedulers": out, "printed": printed.getvalue().splitlines(),
                  "status": torchpatch.status().get("lr-scheduler-state-verbose")}))
"""

# torch 2.15.0 names one scheduler's state differently from torch 1.13-2.6 (torchpatch serves only the
# dropped verbose): SWALR's anneal_func (2.15: _anneal_strategy); on 1.13-2.1 also OneCycleLR's anneal_func
# (_anneal_func_type) and, on 1.13, CyclicLR's _scale_fn_ref.
OLDER_NAMES = {"anneal_func", "_scale_fn_ref"}

# A LambdaLR scheduler's state saved with DCP (3 steps; argv[1]: the folder) or loaded from there into a
# fresh scheduler of this torch, whose last_epoch and learning rate are printed.
DCP = """
import json, sys, warnings, torch, torch.distributed.checkpoint as dcp
warnings.simplefilter("ignore")
opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
state = {"lr_scheduler": sched.state_dict()}
if sys.argv[2] == "save":
    for _ in range(3):
        opt.step()
        sched.step()
    dcp.save({"lr_scheduler": sched.state_dict()}, checkpoint_id=sys.argv[1])
    print(json.dumps({"last_epoch": sched.last_epoch, "lr": sched.get_last_lr()}))
else:
    try:
        dcp.load(state, checkpoint_id=sys.argv[1])
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        print(json.dumps({"error": str(exc)}))
    else:
        sched.load_state_dict(state["lr_scheduler"])
        print(json.dumps({"last_epoch": sched.last_epoch, "lr": sched.get_last_lr()}))
"""


def _keys(out: dict) -> dict:
    return {name: set(sched["keys"]) for name, sched in out["schedulers"].items()}


def _has_verbose(keys: set) -> bool:
    return any(key.rsplit(".", 1)[-1] == "verbose" for key in keys)


@where_patch_applies("lr-scheduler-state-verbose", "torch 2.7 removed the schedulers' verbose")
def test_native_state_dicts_have_verbose():
    native = _keys(run_json(SCHEDULERS))
    assert all(_has_verbose(keys) for keys in native.values()), native
    nested = native["SequentialLR"] | native["ChainedScheduler"]
    assert {"_schedulers[0].verbose", "_schedulers[1].verbose"} <= nested


@where_patch_applies("lr-scheduler-state-verbose")
def test_served_state_dicts_have_the_newest_keys_as_to_verbose():
    newest = _keys(run_newest_torch_json(SCHEDULERS))
    served = run_json(SCHEDULERS, env=clean_env(TORCHPATCH="1"))
    assert served["status"] == "applied"
    for name, keys in _keys(served).items():
        assert not _has_verbose(keys), (name, keys)
        # what this torch still has that 2.15 lacks: only the older names of the same state
        assert {key.rsplit(".", 1)[-1] for key in keys - newest[name]} <= OLDER_NAMES, (name, keys - newest[name])


@where_patch_applies("lr-scheduler-state-verbose", "the scheduler itself keeps this torch's behaviour")
def test_schedulers_behave_as_without_torchpatch():
    native = run_json(SCHEDULERS, args=("verbose",))
    served = run_json(SCHEDULERS, args=("verbose",), env=clean_env(TORCHPATCH="1"))
    assert served["printed"] == native["printed"]
    for name, sched in served["schedulers"].items():
        assert sched["lrs"] == native["schedulers"][name]["lrs"], name
        assert sched["verbose"] == native["schedulers"][name]["verbose"], name
    assert served["schedulers"]["StepLR"]["verbose"] is True


@where_patch_applies("lr-scheduler-state-verbose")
def test_load_state_dict_with_and_without_verbose():
    out = run_json("""
        import json, torch, torchpatch
        def sched(verbose):
            opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
            return torch.optim.lr_scheduler.StepLR(opt, 2, verbose=verbose)
        saved = sched(True)
        for _ in range(3):
            saved.optimizer.step()
            saved.step()
        newer, older = sched(False), sched(False)
        newer.load_state_dict(saved.state_dict())
        older.load_state_dict({**saved.state_dict(), "verbose": True})  # as this torch saved it natively
        print(json.dumps({"epochs": [newer.last_epoch, older.last_epoch, saved.last_epoch],
                          "lrs": [newer.get_last_lr(), older.get_last_lr(), saved.get_last_lr()],
                          "verbose": [newer.verbose, older.verbose]}))
    """, env=clean_env(TORCHPATCH="1"))
    assert out["epochs"] == [3, 3, 3] and out["lrs"][0] == out["lrs"][1] == out["lrs"][2]
    assert out["verbose"] == [False, True]  # without the key the attribute stays as constructed


@through_patch_range("lr-scheduler-state-verbose", "DCP's save/load with checkpoint_id", since="2.4")
def test_dcp_resumes_a_scheduler_torch_2_15_saved(tmp_path):
    folder = str(tmp_path / "ckpt")
    saved = run_newest_torch_json(DCP, folder, "save")
    assert run_json(DCP, args=(folder, "load"), env=clean_env(TORCHPATCH="1")) == saved


@where_patch_applies("lr-scheduler-state-verbose", "DCP loads exactly the local keys")
@through_patch_range("lr-scheduler-state-verbose", "DCP's save/load with checkpoint_id", since="2.4")
def test_native_dcp_load_misses_verbose(tmp_path):
    folder = str(tmp_path / "ckpt")
    run_newest_torch_json(DCP, folder, "save")
    # natively this torch may also fail to read 2.15's metadata (dcp-metadata-strides serves that): only that patch on
    out = run_json(DCP, args=(folder, "load"), env=clean_env(TORCHPATCH="1", TORCHPATCH_LR_SCHEDULER_STATE_VERBOSE="0"))
    assert "Missing key in checkpoint state_dict: lr_scheduler.verbose" in out.get("error", ""), json.dumps(out)


@where_patch_does_not_apply("lr-scheduler-state-verbose", "torch 2.7+ has no verbose: the same expectations hold")
def test_inactive_where_torch_has_no_verbose():
    out = run_json(SCHEDULERS, env=clean_env(TORCHPATCH="1"))
    assert out["status"] is None
    assert not any(_has_verbose(keys) for keys in _keys(out).values())
