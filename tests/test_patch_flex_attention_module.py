"""flex-attention-module: ``torch.nn.attention.flex_attention`` importable on torch 2.4 (public since
2.5). The torchtitan import line loads; a model that imports it but runs SDPA attention works; every
FlexAttention entry point (and ``BlockMask(...)``) raises ``NotImplementedError`` naming torch >= 2.5;
``noop_mask`` is upstream's (a True bool scalar); torch 2.4's private ``_flex_attention`` is left
alone. On torch >= 2.5 the module is torch's own and the patch stays out of the way."""

from conftest import clean_env, import_with_torchpatch, only_torch, run_json, run_py, where_patch_applies

IMPORT = "from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention"


@where_patch_applies("flex-attention-module", "torch 2.4 has only the private _flex_attention")
def test_native_module_not_found():
    proc = run_py(IMPORT)
    assert "ModuleNotFoundError: No module named 'torch.nn.attention.flex_attention'" in proc.stderr, proc.stderr[-2000:]


SERVED = """
import json, torch, torch.nn as nn, torch.nn.functional as F, torchpatch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention  # torchtitan 0.1.0
from torch.nn.attention.flex_attention import (_mask_mod_signature, _score_mod_signature, and_masks,
                                               create_mask, noop_mask, or_masks)
import torch.nn.attention.flex_attention as module
import torch.nn.attention._flex_attention as private  # torch 2.4's prototype: untouched

class Attention(nn.Module):  # imports FlexAttention, runs SDPA (torchtitan's default)
    def __init__(self, use_flex_attn=False):
        super().__init__()
        self.qkv, self.use_flex_attn = nn.Linear(8, 24), use_flex_attn
    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        if self.use_flex_attn:
            return flex_attention(q, k, v, block_mask=create_block_mask(noop_mask, 1, 2, 5, 5))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

torch.manual_seed(0)
x = torch.randn(1, 5, 8)
model = Attention()
got = model(x)
q, k, v = model.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
scores = (q @ k.transpose(-1, -2) / 2).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
out = {"sdpa_model_close": torch.allclose(got, scores.softmax(-1) @ v, atol=1e-6)}

def error(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except NotImplementedError as exc:
        return str(exc)
    return None

t = torch.randn(1, 2, 5, 4)
out["errors"] = {
    "flex_attention": error(flex_attention, t, t, t),
    "create_block_mask": error(create_block_mask, noop_mask, 1, 2, 5, 5),
    "create_mask": error(create_mask, noop_mask, 1, 2, 5, 5),
    "and_masks": error(and_masks, noop_mask, noop_mask),
    "or_masks": error(or_masks, noop_mask),
    "BlockMask": error(BlockMask),
    "flex_model": error(Attention(use_flex_attn=True), x),
}
b, h = torch.tensor(0), torch.tensor(1)
mask = noop_mask(b, h, torch.tensor(2), torch.tensor(3))
out["noop_mask"] = [type(mask).__name__, str(mask.dtype), list(mask.shape), bool(mask)]
out["noop_mask_int64_batch"] = str(noop_mask(torch.tensor(0, dtype=torch.int64), h, h, h).dtype)
out["all"] = sorted(module.__all__)
out["signatures"] = [_mask_mod_signature.__origin__.__name__, len(_mask_mod_signature.__args__),
                     len(_score_mod_signature.__args__)]
out["module_of"] = {n: getattr(module, n).__module__ for n in ("flex_attention", "BlockMask", "noop_mask")}
out["private_flex"] = private._flex_attention.__module__
out["status"] = torchpatch.status().get("flex-attention-module")
print(json.dumps(out))
"""


@where_patch_applies("flex-attention-module")
def test_served_module_imports_and_functions_raise():
    out = run_json(SERVED, env=clean_env(TORCHPATCH="1"))
    assert out["status"] == "applied"
    assert out["sdpa_model_close"] is True
    for name, message in out["errors"].items():
        assert message is not None, name
        assert "needs torch >= 2.5" in message and "torch 2.4" in message, (name, message)
    assert out["errors"]["flex_model"].startswith("torch.nn.attention.flex_attention.create_block_mask needs torch >= 2.5")
    assert out["errors"]["BlockMask"].startswith("torch.nn.attention.flex_attention.BlockMask needs torch >= 2.5")
    assert out["noop_mask"] == ["Tensor", "torch.bool", [], True]
    assert out["noop_mask_int64_batch"] == "torch.bool"
    assert out["all"] == sorted(["flex_attention", "create_block_mask", "create_mask", "and_masks", "or_masks",
                                 "BlockMask", "noop_mask"])
    assert out["signatures"] == ["Callable", 5, 6]  # 4 (5) tensor arguments and the return type
    assert set(out["module_of"].values()) == {"torchpatch.patches.attention.flex_attention_module"}
    assert out["private_flex"] == "torch.nn.attention._flex_attention"


INACTIVE = """
import json, torch, torchpatch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention, noop_mask
import torch.nn.attention.flex_attention as module
b = torch.tensor(0)
mask = noop_mask(b, b, b, b)
print(json.dumps({"module_of": [f.__module__ for f in (flex_attention, create_block_mask, BlockMask, noop_mask)],
                  "file": module.__file__.replace("\\\\", "/").endswith("torch/nn/attention/flex_attention.py"),
                  "noop_mask": [str(mask.dtype), bool(mask)],
                  "status": torchpatch.status().get("flex-attention-module")}))
"""


@only_torch(">=2.5", "torch's own flex_attention module")
def test_inactive_where_torch_has_it():
    out = run_json(INACTIVE, env=clean_env(TORCHPATCH="1"))
    assert out == {"module_of": ["torch.nn.attention.flex_attention"] * 4, "file": True,
                   "noop_mask": ["torch.bool", True], "status": None}


@only_torch("<2.4", "FlexAttention's torch 2.4 placeholder is not served on older torch")
def test_not_served_before_2_4():
    out = import_with_torchpatch('from torch.nn.attention.flex_attention import flex_attention', 'flex-attention-module')
    assert out == {"error": "ModuleNotFoundError", "status": None}
