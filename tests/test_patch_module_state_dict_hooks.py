"""module-state-dict-hooks: ``nn.Module.register_state_dict_post_hook`` and
``register_load_state_dict_pre_hook`` (torch 2.5's public state-dict hooks) on torch 2.4.

Natively 2.4 raises ``AttributeError`` on the first. With the patch: a post hook on a child module edits
the state dict in place (splitting a fused weight, as torchtitan 0.3.0's ``FusedQKVLinear`` does), a
pre hook gets the module and joins it back on load, a handle removes a hook, and a post hook that returns
something raises; the outcome equals torch 2.15's native run (its venv, the same test).
"""

from conftest import clean_env, run_json, run_newest_torch_json, run_py, where_patch_applies

SCRIPT = '''
import json, torch, torch.nn as nn
torch.manual_seed(0)

class Fused(nn.Linear):
    def __init__(self):
        super().__init__(2, 4, bias=False)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._join)

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata):
        a, b = state_dict.pop(prefix + "weight").chunk(2)
        state_dict[prefix + "a"], state_dict[prefix + "b"] = a, b

    @staticmethod
    def _join(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        assert isinstance(module, Fused)
        state_dict[prefix + "weight"] = torch.cat([state_dict.pop(prefix + "a"), state_dict.pop(prefix + "b")])

model = nn.Sequential(Fused(), nn.ReLU())
saved = model.state_dict()
other = nn.Sequential(Fused(), nn.ReLU())
other.load_state_dict(saved)
out = {"keys": sorted(saved), "loaded": torch.equal(other[0].weight, model[0].weight)}
handle = model.register_state_dict_post_hook(lambda m, sd, p, meta: sd.update(extra=torch.zeros(1)))
out["with_extra"] = sorted(model.state_dict())
handle.remove()
out["removed"] = sorted(model.state_dict())
model[1].register_state_dict_post_hook(lambda m, sd, p, meta: {})
try:
    model.state_dict()
    out["error"] = ""
except RuntimeError as exc:
    out["error"] = str(exc)
print(json.dumps(out))
'''


@where_patch_applies("module-state-dict-hooks", "torch 2.5 made the hooks public")
def test_native_attribute_error():
    proc = run_py(SCRIPT)
    assert "has no attribute 'register_state_dict_post_hook'" in proc.stderr, proc.stderr[-2000:]


@where_patch_applies("module-state-dict-hooks")
def test_hooks_as_on_the_newest_torch():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out == run_newest_torch_json(SCRIPT)
    assert out["keys"] == ["0.a", "0.b"] and out["loaded"] and out["error"] == "state_dict post-hook must return None"
