"""checkpoint-early-stop: ``checkpoint(fn, x, use_reentrant=False, early_stop=...)`` on torch 2.4-2.8.

One process: a checkpointed function that counts how often its Python body reaches its end (the
recomputation runs it again unless it stops early, once its saved tensor is back). The counts for
``early_stop`` True and False, inside ``set_checkpoint_early_stop`` contexts (which decide where they
are open), for a checkpoint nested in one with ``early_stop=False`` (it keeps its own), under
``checkpoint_wrapper(..., early_stop=False)`` (torchtitan 0.3's call) and with reentrant checkpointing
(which ignores it) must be torch 2.15's own for the same program, and the gradients the same.
Natively torch 2.4 hands ``early_stop`` to the function or the block (``TypeError``: the error
torchtitan 0.2.2's and 0.3's activation checkpointing meets) and reentrant checkpointing refuses it
(``ValueError``), also with TORCHPATCH=1 and the patch switched off.
"""

from conftest import clean_env, patch_applies_here, run_json, run_newest_torch_json, through_patch_range, \
    where_patch_applies

PROGRAM = """
import json, torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

ends = [0]

def fn(x):
    y = x.sin()  # saves x: the recomputation has all it needs here
    ends[0] += 1
    return y.clone()

def nested(x):
    return checkpoint(fn, x.cos(), use_reentrant=False).exp()

class Block(torch.nn.Module):
    def forward(self, x):
        return fn(x)

def count(call):
    ends[0] = 0
    x = torch.linspace(0.1, 1.0, 5, requires_grad=True)
    call(x).sum().backward()
    return [ends[0], x.grad.tolist()]

out = {
    "default": count(lambda x: checkpoint(fn, x, use_reentrant=False)),
    "true": count(lambda x: checkpoint(fn, x, use_reentrant=False, early_stop=True)),
    "false": count(lambda x: checkpoint(fn, x, use_reentrant=False, early_stop=False)),
    "nested_in_false": count(lambda x: checkpoint(nested, x, use_reentrant=False, early_stop=False)),
    "reentrant": count(lambda x: checkpoint(fn, x, use_reentrant=True, early_stop=False)),
    "wrapper": count(checkpoint_wrapper(Block(), early_stop=False)),
}
for enable in (True, False):
    with set_checkpoint_early_stop(enable):
        out[f"context_{enable}"] = [count(lambda x: checkpoint(fn, x, use_reentrant=False, early_stop=not enable))]
    out[f"after_context_{enable}"] = count(lambda x: checkpoint(fn, x, use_reentrant=False, early_stop=False))
try:
    import torchpatch
    out["status"] = torchpatch.status().get("checkpoint-early-stop")
except ImportError:
    out["status"] = None
print(json.dumps(out))
"""

NATIVE = """
import json, torch
from torch.utils.checkpoint import checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

def fn(x):
    return x.sin()

class Block(torch.nn.Module):
    def forward(self, x):
        return fn(x)

x = torch.ones(2, requires_grad=True)
calls = {  # only calls with the keyword: an early-stopped recomputation raises torch's own
    # _StopRecomputationError through the function, which tools/native_errors.py would record
    "off": lambda: checkpoint(fn, x, use_reentrant=False, early_stop=False),
    "reentrant": lambda: checkpoint(fn, x, use_reentrant=True, early_stop=True),
    "wrapper_off": lambda: checkpoint_wrapper(Block(), early_stop=False)(x),
}
out = {}
for name, call in calls.items():
    try:
        call()
        out[name] = None
    except (TypeError, ValueError) as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@where_patch_applies("checkpoint-early-stop", "checkpoint has no early_stop before torch 2.9")
def test_native_keyword_reaches_the_function():
    for env in ({}, {"TORCHPATCH": "1", "TORCHPATCH_CHECKPOINT_EARLY_STOP": "0"}):
        out = run_json(NATIVE, env=clean_env(**env))
        assert out == {"off": "TypeError: fn() got an unexpected keyword argument 'early_stop'",
                       "reentrant": "ValueError: Unexpected keyword arguments: early_stop",
                       "wrapper_off": "TypeError: Block.forward() got an unexpected keyword argument 'early_stop'"}, \
            (env, out)


@through_patch_range("checkpoint-early-stop", "checkpoint(..., early_stop=...)")
def test_counts_and_gradients_equal_torch_2_15s():
    out = run_json(PROGRAM, env=clean_env(TORCHPATCH="1"))
    assert out.pop("status") == ("applied" if patch_applies_here("checkpoint-early-stop") else None)
    newest = run_newest_torch_json(PROGRAM)
    newest.pop("status")
    assert out == newest
    assert out["default"][0] == 1 and out["false"][0] == 2, out  # the recomputation stopped early or not
