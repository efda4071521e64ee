"""optim-load-keeps-param-names: ``Optimizer.load_state_dict`` keeps the groups' ``param_names``.

One process: an AdamW over two named groups steps once; its state dict, with the groups' names dropped
(as torchtitan 0.3's FQN-keyed checkpoint hands it back), loads into a fresh named optimizer, and a
state dict with names of its own into another: the groups' names after each load, and the loaded
state, must be torch 2.15's own for the same program. Natively torch 2.4 drops the names.
"""

from conftest import clean_env, patch_applies_here, run_json, run_newest_torch_json, through_patch_range, \
    where_patch_applies

PROGRAM = """
import json, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))

def named():
    return torch.optim.AdamW([
        {"params": list(model[0].parameters()), "param_names": ["0.weight", "0.bias"]},
        {"params": list(model[1].parameters()), "param_names": ["1.weight", "1.bias"], "lr": 0.5}])

opt = named()
model(torch.ones(4, 3)).sum().backward()
opt.step()
sd = opt.state_dict()
out = {}
for case, keep in (("without_names", False), ("own_names", True)):
    groups = [dict(g, param_names=[n.upper() for n in g["param_names"]]) if keep else
              {k: v for k, v in g.items() if k != "param_names"} for g in sd["param_groups"]]
    fresh = named()
    fresh.load_state_dict({"state": sd["state"], "param_groups": groups})
    out[case] = {"names": [g.get("param_names") for g in fresh.param_groups], "lr": [g["lr"] for g in fresh.param_groups],
                 "exp_avg": [fresh.state[p]["exp_avg"].tolist() for p in model.parameters()]}
try:
    import torchpatch
    out["status"] = torchpatch.status().get("optim-load-keeps-param-names")
except ImportError:
    out["status"] = None
print(json.dumps(out))
"""


@where_patch_applies("optim-load-keeps-param-names", "torch 2.4's load_state_dict replaces the groups")
def test_native_load_drops_param_names():
    out = run_json(PROGRAM, env=clean_env())
    assert out["without_names"]["names"] == [None, None], out


@through_patch_range("optim-load-keeps-param-names", "param_names through load_state_dict")
def test_names_after_load_equal_torch_2_15s():
    out = run_json(PROGRAM, env=clean_env(TORCHPATCH="1"))
    assert out.pop("status") == ("applied" if patch_applies_here("optim-load-keeps-param-names") else None)
    newest = run_newest_torch_json(PROGRAM)
    newest.pop("status")
    assert out == newest
    assert out["without_names"]["names"] == [["0.weight", "0.bias"], ["1.weight", "1.bias"]], out
