"""fsdp2-set-reshard-after-forward: ``FSDPModule.set_reshard_after_forward(value, recurse=True)`` on
torch 2.4.

On 2 real ranks (gloo), float64: an MLP of three Linear layers (the last of 5 rows: uneven over 2
ranks), the first two sharded alone, the root holding the last, trains 3 SGD steps, each rank on its
half of the batch: step 1 with fully_shard's default (the non-root layers reshard after forward), step
2 after ``root.set_reshard_after_forward(False)`` (recursive: every layer keeps its parameters
unsharded from forward to backward), step 3 after ``layer2.set_reshard_after_forward(True,
recurse=False)`` (that layer alone reshards again). Between each forward and its backward the test
reads which layers hold sharded parameters (DTensors), as torch 2.6+ gives natively; losses and full
parameters equal the same model's on one process on the full batch in the same run (gathering in
backward or not, the values are the same). A value that is not a bool raises torch 2.6's
``ValueError``. Torch 2.4 natively (and with the patch switched off) has no such method.
"""

from conftest import (
    clean_env, gathered_tail, patch_applies_here, ranks_result, through_patch_range, where_patch_applies
)
from fsdp2_scripts import TRAIN_AGAINST_REFERENCE, head

PATCH_ID = "fsdp2-set-reshard-after-forward"

RANKS = head() + """
model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 5)).double()
x, y = torch.randn(W, 3, 4, dtype=torch.float64), torch.randn(W, 3, 5, dtype=torch.float64)

def loss(m, r):
    return nn.functional.mse_loss(m(x[r]), y[r])
""" + TRAIN_AGAINST_REFERENCE + """
m = copy.deepcopy(model)
fully_shard(m[0], mesh=mesh)
fully_shard(m[2], mesh=mesh)
fully_shard(m, mesh=mesh)
out = {"sharded_after_forward": []}
try:
    m.set_reshard_after_forward(1)
except ValueError as exc:
    out["not_a_bool"] = str(exc)

def before_forward(step):
    if step == 1:
        m.set_reshard_after_forward(False)
    if step == 2:
        m[2].set_reshard_after_forward(True, recurse=False)

def after_forward(step):
    out["sharded_after_forward"].append([type(m[i].weight).__name__ == "DTensor" for i in (0, 2)])

out.update(train_against_reference(m, rank, W, before_forward=before_forward, after_forward=after_forward))
"""

NATIVE = head() + """
layer = fully_shard(nn.Linear(4, 4), mesh=mesh)
try:
    layer.set_reshard_after_forward(False)
    out = {"error": None}
except AttributeError as exc:
    out = {"error": f"{type(exc).__name__}: {exc}"}
"""


def run(tmp_path, script, **env) -> list:
    return ranks_result(script + gathered_tail(PATCH_ID), tmp_path=tmp_path, env=clean_env(**env), timeout=180)


@where_patch_applies(PATCH_ID, "torch 2.6 added the method")
def test_native_fsdp_module_has_no_setter(tmp_path):
    for env in ({}, {"TORCHPATCH": "1", "TORCHPATCH_FSDP2_SET_RESHARD_AFTER_FORWARD": "0"}):
        for out in run(tmp_path, NATIVE, **env):
            assert out["error"] == "AttributeError: 'FSDPLinear' object has no attribute 'set_reshard_after_forward'", out


@through_patch_range(PATCH_ID, "FSDP2's set_reshard_after_forward")
def test_setter_changes_what_forward_keeps_and_trains_to_the_reference(tmp_path):
    for out in run(tmp_path, RANKS, TORCHPATCH="1"):
        assert out.pop("status") == ("applied" if patch_applies_here(PATCH_ID) else None), out
        assert out.pop("not_a_bool") == "reshard_after_forward should be a bool, got <class 'int'>", out
        assert out.pop("sharded_after_forward") == [[True, True], [False, False], [False, True]], out
        # float64: the same sums in another order (~1e-16); a wrong gradient: ~1e-1
        assert out.pop("loss_diff") < 1e-12 and out.pop("param_diff") < 1e-12, out
        assert out == {}, out
