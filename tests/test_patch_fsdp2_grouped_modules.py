"""fsdp2-grouped-modules: ``fully_shard([module_a, module_b])`` on torch 2.4.

On 2 real ranks (gloo), float64: a small model (Linear, tanh, LayerNorm, an output Linear of 5 rows:
uneven over 2 ranks) whose ``mid`` layer is sharded alone and whose final norm and output projection are
sharded as one list, ``fully_shard([model.norm, model.out])`` (torchtitan 0.2.2 and 0.3.0's layout),
then the root, trains 3 SGD steps, each rank on its half of the batch; losses and full parameters are
compared with the same model trained on one process on the full batch in the same run. Torch 2.4
natively (and with the patch switched off) stops at the call with 2.4's composable contract's
``AttributeError``; with TORCHPATCH=1 it trains to the reference, as torch 2.5+ does natively with one
FSDP group. What a caller sees of the group is 2.5's: the call returns the list it was given, its
modules become FSDP modules, a listed module inside another listed one is left to that one, and a
setter or ``unshard``/``reshard`` on one module of the list acts on the other (2.5: one state): after
``norm.unshard()`` the output layer's parameters are unsharded too, after
``norm.set_requires_gradient_sync(False, recurse=False)`` a backward leaves the output layer's sharded
gradients unset as well. Modules that share a parameter are refused on 2.4 (2.5's one group over tied
weights is not served).
"""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, gathered_tail, patch_applies_here, ranks_result,
    through_patch_range, where_patch_applies
)
from fsdp2_scripts import TRAIN_AGAINST_REFERENCE, head

PREAMBLE = head("FSDPModule, fully_shard") + """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.mid, self.norm, self.out = nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 5)

    def forward(self, x):
        return self.out(self.norm(torch.tanh(self.mid(x))))

model = Model().double()
x, y = torch.randn(W, 3, 4, dtype=torch.float64), torch.randn(W, 3, 5, dtype=torch.float64)

def loss(m, r):
    return nn.functional.mse_loss(m(x[r]), y[r])
"""

RANKS = PREAMBLE + TRAIN_AGAINST_REFERENCE + """
m = copy.deepcopy(model)
fully_shard(m.mid, mesh=mesh)
listed = [m.norm, m.out]
returned = fully_shard(listed, mesh=mesh)
fully_shard(m, mesh=mesh)
out = {"returned_the_list": returned is listed,
       "fsdp_modules": [isinstance(module, FSDPModule) for module in (m.mid, m.norm, m.out)]}
out.update(train_against_reference(m, rank, W))  # 3 SGD steps, each rank on its batch

def sharded(module):  # whether the module's registered parameters are FSDP's sharded DTensors
    return [type(p).__name__ == "DTensor" for p in module.parameters()]

m.norm.unshard()  # one group (2.5): the output layer's parameters are all-gathered with the norm's
out["after_unshard"] = {"mid": sharded(m.mid), "norm": sharded(m.norm), "out": sharded(m.out)}
m.norm.reshard()
out["after_reshard"] = sharded(m.out)
m.norm.set_requires_gradient_sync(False, recurse=False)  # the group's gradients stay unreduced
m.zero_grad(set_to_none=True)
loss(m, rank).backward()
out["grad_set_without_sync"] = {name: p.grad is not None for name, p in m.named_parameters()}
"""

# in the same ranks: a listed module inside another listed one; modules sharing a parameter
RANKS += """
m = copy.deepcopy(model)
inner = nn.Sequential(m.mid)  # mid inside inner: fully_shard([inner, mid]) shards inner (mid in its group)
fully_shard([inner, m.mid], mesh=mesh)
out["nested"] = {"fsdp_modules": [isinstance(module, FSDPModule) for module in (inner, m.mid)],
                 "mid_sharded": type(m.mid.weight).__name__ == "DTensor"}
m = copy.deepcopy(model)
m.out.weight = m.mid.weight  # tied (no forward here): only one group over both modules makes this right
try:
    fully_shard([m.mid, m.out], mesh=mesh)
    out["shared"] = None
except NotImplementedError as exc:
    out["shared"] = str(exc)
"""

NATIVE = PREAMBLE + """
try:
    fully_shard([model.norm, model.out], mesh=mesh)
    out = "sharded"
except Exception as exc:
    out = f"{type(exc).__name__}: {exc}"
gathered = [None] * W
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

PATCH_ID = "fsdp2-grouped-modules"


def run(tmp_path, script: str, **env) -> list:
    return ranks_result(script + gathered_tail(PATCH_ID), tmp_path=tmp_path, env=clean_env(**env), timeout=180)


@where_patch_applies(PATCH_ID, "fully_shard takes one module before torch 2.5")
def test_native_fully_shard_of_a_list_fails(tmp_path):
    for env in ({}, {"TORCHPATCH": "1", "TORCHPATCH_FSDP2_GROUPED_MODULES": "0"}):
        outs = ranks_result(NATIVE, tmp_path=tmp_path, env=clean_env(**env), timeout=180)
        assert outs == ["AttributeError: 'list' object has no attribute '__dict__'"] * 2, (env, outs)


@through_patch_range(PATCH_ID, "fully_shard of a list")
def test_listed_modules_train_to_the_reference_as_one_group(tmp_path):
    """One group's numerics and behaviour; a nested listed module; tied modules (refused where the patch
    applies, one group natively from 2.5)."""
    for out in run(tmp_path, RANKS, TORCHPATCH="1"):
        assert out.pop("status") == ("applied" if patch_applies_here(PATCH_ID) else None), out
        assert out.pop("returned_the_list") is True and out.pop("fsdp_modules") == [True] * 3, out
        # float64: the same sums in another order (~1e-16); a gradient not averaged over the ranks: ~1e-1
        assert out.pop("loss_diff") < 1e-12 and out.pop("param_diff") < 1e-12, out
        assert out.pop("after_unshard") == {"mid": [True, True], "norm": [False, False], "out": [False, False]}, out
        assert out.pop("after_reshard") == [True, True], out
        assert out.pop("grad_set_without_sync") == {
            "mid.weight": True, "mid.bias": True, "norm.weight": False, "norm.bias": False,
            "out.weight": False, "out.bias": False}, out
        # a listed module inside another listed one is left to it (2.5: the list's root modules)
        assert out.pop("nested") == {"fsdp_modules": [True, False], "mid_sharded": True}, out
        shared = out.pop("shared")  # one group over tied modules is torch 2.5's; refused where the patch applies
        if patch_applies_here(PATCH_ID):
            assert shared.startswith("fully_shard(list of modules): modules 0 and 1 share a parameter"), out
        else:
            assert shared is None, out
        assert out == {}, out


