"""checkpoint-early-stop: ``checkpoint(..., early_stop=...)`` and ``checkpoint_wrapper(module,
early_stop=...)`` on torch 2.4-2.8.

One process, float64. A checkpointed function whose last statement (after the last tensor backward
needs) appends to a list: the list says whether backward's recomputation ran to the end (early stop
off) or stopped once it had what backward needs (early stop on, the default). On torch 2.4 natively
the keyword reaches the function (``TypeError``: the error torchtitan 0.2.2's activation checkpointing
meets); with TORCHPATCH=1, as torch 2.9+ natively: ``early_stop=False`` recomputes to the end,
``early_stop=True`` and no keyword stop early, an open ``set_checkpoint_early_stop`` context overrides
the keyword, reentrant checkpointing ignores it, and through ``checkpoint_wrapper`` the same; the
gradients equal those of the function without checkpointing in every case.
"""

from conftest import clean_env, patch_applies_here, run_json, through_patch_range, where_patch_applies

PATCH_ID = "checkpoint-early-stop"

SCRIPT = """
import json, torch, torch.nn as nn
import torch.utils.checkpoint as cp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

ends = []

def fn(x):
    y = x.sin().exp()
    ends.append(1)  # reached again in backward only if the recomputation does not stop early
    return y

class Block(nn.Module):
    def forward(self, x):
        return fn(x)

x = torch.linspace(0, 1, 5, dtype=torch.float64, requires_grad=True)
want = torch.autograd.grad(fn(x).sum(), x)[0]

def recomputed_to_the_end(call):
    ends.clear()
    try:
        y = call()
    except (TypeError, ValueError) as exc:  # torch 2.4: the keyword reaches the function, or reentrant refuses it
        return f"{type(exc).__name__}: {exc}"
    x.grad = None
    y.sum().backward()  # not autograd.grad: reentrant checkpointing refuses it
    g = x.grad
    assert torch.allclose(g, want, rtol=1e-14, atol=0), (g, want)
    return len(ends) == 2

cases = {
    "off": lambda: cp.checkpoint(fn, x, use_reentrant=False, early_stop=False),
    "on": lambda: cp.checkpoint(fn, x, use_reentrant=False, early_stop=True),
    "default": lambda: cp.checkpoint(fn, x, use_reentrant=False),
    "reentrant": lambda: cp.checkpoint(fn, x, use_reentrant=True, early_stop=True),
    "wrapper_off": lambda: checkpoint_wrapper(Block(), early_stop=False)(x),
}
out = {name: recomputed_to_the_end(call) for name, call in cases.items() if name in ONLY}
if "context" in ONLY:
    with cp.set_checkpoint_early_stop(True):  # an open context overrides the keyword
        out["context_on_keyword_off"] = recomputed_to_the_end(
            lambda: cp.checkpoint(fn, x, use_reentrant=False, early_stop=False))
import torchpatch
out["status"] = torchpatch.status().get(PATCH_ID) if torchpatch.is_installed() else None
print(json.dumps(out))
""".replace("PATCH_ID", repr(PATCH_ID))
ALL = ("off", "on", "default", "reentrant", "wrapper_off", "context")
# natively only the calls with the keyword (an early-stopped recomputation raises torch's own
# _StopRecomputationError through the function, which tools/native_errors.py would record)
WITH_KEYWORD = ("off", "reentrant", "wrapper_off")


def run(only, **env) -> dict:
    return run_json(SCRIPT.replace("ONLY", repr(only)), env=clean_env(**env))


@where_patch_applies(PATCH_ID, "torch 2.9 added the keyword")
def test_native_keyword_reaches_the_function():
    for env in ({}, {"TORCHPATCH": "1", "TORCHPATCH_CHECKPOINT_EARLY_STOP": "0"}):
        out = run(WITH_KEYWORD, **env)
        assert out["off"] == "TypeError: fn() got an unexpected keyword argument 'early_stop'", (env, out)
        assert out["wrapper_off"] == "TypeError: Block.forward() got an unexpected keyword argument 'early_stop'", out
        assert out["reentrant"] == "ValueError: Unexpected keyword arguments: early_stop", out


@through_patch_range(PATCH_ID, "checkpoint's early_stop keyword")
def test_keyword_decides_whether_recomputation_stops_early():
    out = run(ALL, TORCHPATCH="1")
    assert out.pop("status") == ("applied" if patch_applies_here(PATCH_ID) else None), out
    # reentrant checkpointing reruns the whole function in backward whatever the setting
    assert out == {"off": True, "on": False, "default": False, "reentrant": True, "wrapper_off": True,
                   "context_on_keyword_off": False}, out
