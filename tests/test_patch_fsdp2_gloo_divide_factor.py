"""fsdp2-gloo-divide-factor: FSDP2 with a gradient divide factor on gloo. On 2 real ranks, a small
float64 MLP under ``fully_shard`` with ``set_gradient_divide_factor(f)`` dies natively with "Cannot use
ReduceOp.PREMUL_SUM with Gloo" (float32: FSDP2 takes the pre-multiplied sum for float32/bfloat16 only);
with TORCHPATCH=1 its sharded gradients equal (sum of the ranks' own gradients) / f, computed in the
same run on one process (to float32 rounding of a sum in another order), and a factor equal to the group size (torch's
AVG path) is left to torch. Below torch 2.8 (no divide factor) the patch stays out of the way."""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, rank_result, run_ranks, where_patch_applies,
    where_patch_does_not_apply
)
from fsdp2_scripts import SUMMED_GRADS, head

RANKS = head(home="torch.distributed.fsdp") + """
FACTOR = FACTOR_VALUE
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
xs, ys = torch.randn(W, 6, 8), torch.randn(W, 6, 4)
""" + SUMMED_GRADS + """
# the reference: every rank's own gradient, computed on one process, summed, divided by the factor
ref = [a / FACTOR for a in summed_grads()]

sharded = copy.deepcopy(model)
for layer in sharded:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(sharded, mesh=mesh)
for module in sharded.modules():  # each FSDP module's own parameter group (as torchtitan does)
    if hasattr(module, "set_gradient_divide_factor"):
        module.set_gradient_divide_factor(FACTOR)
try:
    nn.functional.mse_loss(sharded(xs[rank]), ys[rank]).backward()
    grads = [p.grad.full_tensor() for p in sharded.parameters()]
    out = {"error": None, "max_diff": rel_diff(grads, ref)}
except RuntimeError as exc:
    out = {"error": str(exc).splitlines()[0]}
import torchpatch
out["status"] = torchpatch.status().get("fsdp2-gloo-divide-factor") if torchpatch.is_installed() else None
if out["error"]:  # a failed collective: rank 0 reports, every rank leaves at once
    if rank == 0:
        print(RESULT + json.dumps([out]), flush=True)
    import os
    os._exit(0)
gathered = [None] * W
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


def run(tmp_path, factor, **env):
    script = RANKS.replace("FACTOR_VALUE", repr(factor))
    proc = run_ranks(script, env=clean_env(**env), tmp_path=tmp_path, timeout=180)
    return rank_result(proc)


@where_patch_applies("fsdp2-gloo-divide-factor", "the gradient divide factor came with torch 2.8")
def test_native_premul_sum_error(tmp_path):
    outs = run(tmp_path, 4.0)
    assert "Cannot use ReduceOp.PREMUL_SUM with Gloo" in outs[0]["error"], outs


@where_patch_applies("fsdp2-gloo-divide-factor")
def test_sum_then_divide_equals_reference(tmp_path):
    for factor in (4.0, 2.0):  # 2.0 is the group size: torch's own AVG path, left alone
        outs = run(tmp_path, factor, TORCHPATCH="1")
        for out in outs:
            assert out["error"] is None and out["max_diff"] < 1e-5, (factor, outs)
            assert out["status"] == "applied", out


@where_patch_does_not_apply("fsdp2-gloo-divide-factor", "no gradient divide factor before torch 2.8: nothing to do")
def test_inactive_before_2_8(tmp_path):
    proc = run_ranks("import torchpatch, json\nprint('TP ' + json.dumps(torchpatch.status().get('fsdp2-gloo-divide-factor')))\n",
                     nproc=1, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path, timeout=120)
    assert "TP null" in proc.stdout, proc.stdout + proc.stderr
