"""checkpoint-async-save: ``dcp.async_save`` on torch 2.0-2.2 is a synchronous ``dcp.save`` that
returns a completed future; the same script runs against torch's own ``async_save`` from 2.3 (the
reference: same checkpoint, same metadata, a snapshot of the state at the call)."""

from conftest import clean_env, only_torch, run_json, torch_matches, where_patch_applies

USE = """
import json, sys, warnings, torch, torch.nn as nn, torchpatch
import torch.distributed.checkpoint as dcp
from concurrent.futures import Future
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.state_dict_saver import async_save as saver_async_save
warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"

class Progress:  # Stateful, as torchtitan's train state
    def __init__(self, step):
        self.step = step
    def state_dict(self):
        return {"step": torch.tensor(self.step)}
    def load_state_dict(self, sd):
        self.step = int(sd["step"])

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
saved = {k: v.clone() for k, v in model.state_dict().items()}
future = dcp.async_save({"model": get_model_state_dict(model), "progress": Progress(7)}, checkpoint_id=sys.argv[1])
with torch.no_grad():  # training goes on after the call: the checkpoint keeps the state at the call
    for p in model.parameters():
        p.add_(1.0)
metadata = future.result(timeout=60)
fresh, progress = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)), Progress(0)
state = {"model": get_model_state_dict(fresh), "progress": progress}
dcp.load(state, checkpoint_id=sys.argv[1])
set_model_state_dict(fresh, state["model"])
print(json.dumps({
    "future": isinstance(future, Future), "done": future.done(), "metadata": type(metadata).__name__,
    "keys": sorted(metadata.state_dict_metadata), "restored": all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items()),
    "step": progress.step, "saver_same": saver_async_save is dcp.async_save,
    "module": dcp.async_save.__module__, "status": torchpatch.status().get("checkpoint-async-save"),
}))
"""

KEYS = ["model.0.bias", "model.0.weight", "model.2.bias", "model.2.weight", "progress.step"]


@where_patch_applies("checkpoint-async-save", "torch 2.3 added async_save")
def test_native_failure():
    out = run_json(
        """
        import json, torch.distributed.checkpoint as dcp
        try:
            dcp.async_save
        except AttributeError as exc:
            print(json.dumps(str(exc)))
        """
    )
    assert out == "module 'torch.distributed.checkpoint' has no attribute 'async_save'"


@where_patch_applies("checkpoint-async-save")
def test_served_synchronous_save(tmp_path):
    out = run_json(USE, env=clean_env(TORCHPATCH="1"), args=(str(tmp_path / "ckpt"),))
    assert out["module"] == "torchpatch.patches.checkpoint.checkpoint_async_save" and out["status"] == "applied"
    assert out["future"] and out["done"] and out["metadata"] == "Metadata"
    assert out["keys"] == KEYS and out["restored"] and out["step"] == 7 and out["saver_same"]


@only_torch(">=2.3", "torch's own async_save: the same results, nothing served")
def test_inactive_where_torch_has_it(tmp_path):
    out = run_json(USE, env=clean_env(TORCHPATCH="1"), args=(str(tmp_path / "ckpt"),))
    assert out["module"] == "torch.distributed.checkpoint.state_dict_saver" and out["status"] is None
    assert out["future"] and out["done"] and out["metadata"] == "Metadata"
    assert out["keys"] == KEYS and out["step"] == 7 and out["saver_same"]
    # torch 2.4 stages CPU tensors without copying them, so its background write races with the
    # update made after the call (seen both ways); torch 2.13 keeps the state at the call.
    assert out["restored"] or not torch_matches(">=2.13")


@only_torch("<2.0", "1.13 gets no dcp.save (checkpoint-modules), hence no async_save either")
def test_not_served_on_113():
    out = run_json(
        """
        import json, torch.distributed.checkpoint as dcp, torchpatch
        print(json.dumps({"save": hasattr(dcp, "save"), "async_save": hasattr(dcp, "async_save"),
                          "status": torchpatch.status().get("checkpoint-async-save")}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out == {"save": False, "async_save": False, "status": None}
