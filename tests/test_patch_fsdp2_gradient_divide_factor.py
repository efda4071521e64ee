"""fsdp2-gradient-divide-factor: ``FSDPModule.set_gradient_divide_factor(factor)`` on torch 2.4.

On 2 real ranks (gloo), float32 (the dtype torch 2.4 averages with ``ReduceOp.AVG``): a small MLP whose
first layer is sharded alone and whose last layer is in the root's group. With a factor set on every
FSDP module (torchtitan 0.3.0 sets 1.0: it divides the loss by the global token count itself), each
sharded gradient equals (the sum of the ranks' own gradients) / factor; with the factor set on the
root alone, the first layer's gradients stay averaged (2.4's and 2.15's default) and the root's are
summed and divided: both computed on one process in the same run. Torch 2.4 natively (and with the patch
switched off) has no such method (``AttributeError``); 2.8+ has it natively (on gloo, float32, with
fsdp2-gloo-divide-factor's sum-then-divide).
"""

from conftest import (
    clean_env, gathered_tail, patch_applies_here, ranks_result, through_patch_range, where_patch_applies
)
from fsdp2_scripts import SUMMED_GRADS, head

PATCH_ID = "fsdp2-gradient-divide-factor"

RANKS = head() + """
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5))
xs, ys = torch.randn(W, 6, 8), torch.randn(W, 6, 5)
""" + SUMMED_GRADS + """
summed = summed_grads()  # the reference: every rank's own gradient, computed on one process, summed

def sharded_grads(factor, where):
    m = copy.deepcopy(model)
    fully_shard(m[0], mesh=mesh)
    fully_shard(m, mesh=mesh)
    for module in {"every": [m[0], m], "root": [m]}[where]:
        module.set_gradient_divide_factor(factor)
    nn.functional.mse_loss(m(xs[rank]), ys[rank]).backward()
    return [p.grad.full_tensor() for p in m.parameters()]

out = {}
try:
    for factor in (1.0, 3.0):
        out[f"every_{factor}"] = rel_diff(sharded_grads(factor, "every"), [s / factor for s in summed])
    # the root's factor alone: the first layer (its own group) keeps the average
    want = [s / W for s in summed[:2]] + [s / 3.0 for s in summed[2:]]
    out["root_only"] = rel_diff(sharded_grads(3.0, "root"), want)
except AttributeError as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
"""


def run(tmp_path, **env) -> list:
    return ranks_result(RANKS + gathered_tail(PATCH_ID), tmp_path=tmp_path, env=clean_env(**env), timeout=180)


@where_patch_applies(PATCH_ID, "torch 2.8 added the method")
def test_native_fsdp_module_has_no_divide_factor(tmp_path):
    for env in ({}, {"TORCHPATCH": "1", "TORCHPATCH_FSDP2_GRADIENT_DIVIDE_FACTOR": "0"}):
        for out in run(tmp_path, **env):
            assert out["error"] == "AttributeError: 'FSDPLinear' object has no attribute 'set_gradient_divide_factor'", out


@through_patch_range(PATCH_ID, "FSDP2's gradient divide factor")
def test_gradients_summed_then_divided_by_the_factor(tmp_path):
    for out in run(tmp_path, TORCHPATCH="1"):
        assert out.pop("status") == ("applied" if patch_applies_here(PATCH_ID) else None), out
        # float32 sums in another order: ~1e-7 relative; a gradient averaged instead of summed: 0.5
        assert all(diff < 1e-5 for diff in out.values()), out
        assert sorted(out) == ["every_1.0", "every_3.0", "root_only"], out
