"""fsdp2-manual-finalization: FSDP2's manual backward finalization (torch 2.15's API) on torch 2.4-2.14.

On 2 real ranks (gloo, float64), a small MLP sharded per layer and at the root (its first layer's input
needs no gradient, so autograd never reaches that group's post-backward and manual mode defers it) runs
forward and backward over two microbatches per rank, compared with the same model on one process with
every rank's batch (computed in the run): automatically finalized (with no call into the patch's code:
its wraps wait for manual mode); manually, with ``finalize_backward()``; accumulating both microbatches
without gradient sync, then ``finalize_backward()``, and again with
``finalize_backward(async_op=True).wait()``; automatically again once the mode is switched off. Each
equals the reference (float64 to 1e-12). Along the way the errors torch 2.15 raises (finalize in
automatic mode, during backward, on a non-root, before the wait; a mode change during and after
backward, and after an automatic backward that is not the last; manual mode set on a non-root before
lazy init; forward before the wait; a wait on a handle ``reset_iter_state`` invalidated, where torch has
``reset_iter_state``) come with 2.15's messages. The same script runs with TORCHPATCH=1 where the patch
applies and natively on torch 2.15, which validates the expectations; natively (or with the patch off)
torch 2.4-2.14 lack the names.
"""

import pytest

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, patch_applies_here, ranks_result, run_json,
    through_patch_range, torch_matches, where_patch_applies, where_patch_does_not_apply
)
from fsdp2_scripts import head

RANKS = head("GradientReductionHandle, fully_shard", "torch.distributed.fsdp") + """
model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3)).double()
x, y = torch.randn(W, 2, 3, 4, dtype=torch.float64), torch.randn(W, 2, 3, 3, dtype=torch.float64)

def loss(m, r, part):  # rank r's microbatch ``part``; a rank's loss is the mean of its two
    return ((m(x[r, part]) - y[r, part]) ** 2).mean() / 2

ref = copy.deepcopy(model)  # one process, every rank's batch
sum(loss(ref, r, p) for r in range(W) for p in range(2)).div(W).backward()

def sharded():
    m = copy.deepcopy(model)
    for layer in (m[0], m[2]):  # m[0]'s input needs no grad: autograd never reaches its post-backward
        fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)

def compare(m):
    # float64; the sharded run averages across ranks, the reference sums the ranks' losses / W: equal
    # up to the order of a few float64 additions (<< 1e-12)
    diff = max(float((p.grad.full_tensor() - q.grad).abs().max()) for p, q in zip(m.parameters(), ref.parameters()))
    return "reference" if diff < 1e-12 else f"differs by {diff:.3g}"

def error(fn):
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return None

def step(m, sync=True):
    m.set_requires_gradient_sync(sync)
    for part in range(2):
        loss(m, rank, part).backward()
    m.set_requires_gradient_sync(True)  # before finalization: reduces what the microbatches accumulated

out = {}
m = sharded()
import os, sys, torchpatch
calls, patches = [], os.path.join(os.path.dirname(torchpatch.__file__), "patches", "fsdp")
sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_name)  # into this patch's code: none
               if event == "call" and frame.f_code.co_filename.startswith(patches)
               and "manual_finalization" in frame.f_code.co_filename else None)
step(m)
sys.setprofile(None)
out["automatic_calls"] = calls
out["automatic"] = compare(m)
out["automatic_finalize"] = error(m.finalize_backward)
a = sharded()  # an automatic backward that is not the last: the mode cannot change until it is finalized
a.set_is_last_backward(False)
loss(a, rank, 0).backward()
out["mode_after_automatic_backward"] = error(lambda: a.set_manual_backward_finalization(True))

m = sharded()
early = m.finalize_backward(async_op=True)  # before the first forward: no-ops
out["before_forward"] = [m.finalize_backward(), isinstance(early, GradientReductionHandle), early.wait()]
m.set_manual_backward_finalization(True)
msgs = {}
def in_backward(grad):
    msgs["finalize_during_backward"] = error(m.finalize_backward)
    msgs["mode_during_backward"] = error(lambda: m.set_manual_backward_finalization(False))
    return grad
h = m[2].register_forward_hook(lambda mod, i, o: (o.register_hook(in_backward), o)[1])
loss(m, rank, 0).backward()
h.remove()
loss(m, rank, 1).backward()
out.update(msgs)
out["mode_after_backward"] = error(lambda: m.set_manual_backward_finalization(False))
out["non_root"] = error(m[0].finalize_backward)
out["set_non_root"] = error(lambda: m[0].set_manual_backward_finalization(True))
out["finalize"] = m.finalize_backward()
out["manual"] = compare(m)
for p in m.parameters():  # again, accumulating two microbatches without gradient sync
    p.grad = None
step(m, sync=False)
m.finalize_backward()
out["manual_accumulated"] = compare(m)
for p in m.parameters():
    p.grad = None
step(m, sync=False)
handle = m.finalize_backward(async_op=True)
out["handle"] = [isinstance(handle, GradientReductionHandle), GradientReductionHandle.__module__]
out["forward_before_wait"] = error(lambda: m(x[rank, 0]))
out["finalize_before_wait"] = error(m.finalize_backward)
handle.wait()
handle.wait()
out["manual_async_accumulated"] = compare(m)
out["mode_off"] = m.set_manual_backward_finalization(False)
for p in m.parameters():
    p.grad = None
step(m)
out["automatic_again"] = compare(m)

sub = sharded()
sub[2].set_manual_backward_finalization(True)
out["set_before_lazy_init_on_non_root"] = error(lambda: sub(x[rank, 0]))
if hasattr(m, "reset_iter_state"):  # torch >= 2.13
    m.set_manual_backward_finalization(True)
    step(m)
    handle = m.finalize_backward(async_op=True)
    m.reset_iter_state()
    out["wait_after_reset"] = error(handle.wait)
import torchpatch
out["status"] = torchpatch.status().get("fsdp2-manual-finalization")
gathered = [None] * W
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

# torch 2.15's own messages (the script runs natively on 2.15 against the same expectations)
EXPECTED = {
    "automatic_calls": [],
    "automatic": "reference",
    "mode_after_automatic_backward": "set_manual_backward_finalization cannot change mode after backward starts",
    "automatic_finalize": "FSDP finalize_backward requires manual backward finalization. Call "
                          "set_manual_backward_finalization(True) before forward",
    "before_forward": [None, True, None],
    "finalize_during_backward": "FSDP finalize_backward must be called after backward completes",
    "mode_during_backward": "set_manual_backward_finalization cannot change mode during backward",
    "mode_after_backward": "set_manual_backward_finalization cannot change mode after backward starts",
    "non_root": "finalize_backward must be called on the root FSDP module",
    "set_non_root": "set_manual_backward_finalization must be called on the root FSDP module",
    "finalize": None,
    "manual": "reference",
    "manual_accumulated": "reference",
    "handle": [True, "torch.distributed.fsdp"],
    "forward_before_wait": "The previous gradient reduction must be waited on before forward",
    "finalize_before_wait": "The previous gradient reduction must be waited on before finalizing backward again",
    "manual_async_accumulated": "reference",
    "mode_off": None,
    "automatic_again": "reference",
    "set_before_lazy_init_on_non_root": "set_manual_backward_finalization must be called on the root FSDP module",
}
RESET = {"wait_after_reset": "This gradient reduction handle was invalidated"}  # torch >= 2.13 has reset_iter_state


@through_patch_range("fsdp2-manual-finalization", "FSDP2 on CPU")
def test_manual_finalization_matches_automatic_and_one_process(tmp_path):
    ranks = ranks_result(RANKS, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=240)
    expected = {**EXPECTED, **(RESET if torch_matches(">=2.13") else {}),
                "status": "applied" if patch_applies_here("fsdp2-manual-finalization") else None}
    assert ranks == [expected, expected]


NAMES = """
import json, torch, torchpatch
try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # torch 2.4-2.5 without torchpatch
    from torch.distributed._composable.fsdp import FSDPModule
try:
    from torch.distributed.fsdp import GradientReductionHandle
    handle = GradientReductionHandle.__module__
except ImportError:
    handle = None
methods = {name: getattr(getattr(FSDPModule, name, None), "__module__", None)
           for name in ("set_manual_backward_finalization", "finalize_backward")}
print(json.dumps({"handle": handle, "methods": methods,
                  "status": torchpatch.status().get("fsdp2-manual-finalization")}))
"""


@where_patch_applies("fsdp2-manual-finalization", "torch < 2.15 lacks manual backward finalization")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_FSDP2_MANUAL_FINALIZATION": "0"}],
                         ids=["unset", "opted-out"])
def test_native_lacks_manual_finalization(env):
    out = run_json(NAMES, env=clean_env(**env))
    assert out == {"handle": None, "methods": {"set_manual_backward_finalization": None, "finalize_backward": None},
                   "status": None}


@where_patch_applies("fsdp2-manual-finalization")
def test_served_names():
    out = run_json(NAMES, env=clean_env(TORCHPATCH="1"))
    served = "torchpatch.patches.fsdp._manual_finalization"
    assert out == {"handle": "torch.distributed.fsdp",
                   "methods": {"set_manual_backward_finalization": served, "finalize_backward": served},
                   "status": "applied"}


@where_patch_does_not_apply("fsdp2-manual-finalization")
@only_torch(">=2.15")
def test_inactive_where_torch_has_it():
    out = run_json(NAMES, env=clean_env(TORCHPATCH="1"))
    own = "torch.distributed.fsdp._fully_shard._fully_shard"
    assert out == {"handle": "torch.distributed.fsdp",
                   "methods": {"set_manual_backward_finalization": own, "finalize_backward": own}, "status": None}
