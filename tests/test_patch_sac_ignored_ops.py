"""sac-ignored-ops: ``torch.utils.checkpoint.SAC_IGNORED_OPS`` on torch 2.4 is torch 2.4's own
``_ignored_ops``. On every torch from 2.4 it holds detach, prim.device and FunctionalTensor's metadata
functions, and an op added to it is no longer put to the selective checkpointing policy (torch 2.4's
own ``_pt2_selective_checkpoint_context_fn_gen``, and the public API torchpatch serves there, both
consult it), with gradients unchanged."""

from conftest import clean_env, run_json, run_py, through_patch_range, where_patch_applies

SCRIPT = """
import json, torch
import torch.utils.checkpoint as cp
from torch.utils.checkpoint import SAC_IGNORED_OPS
aten = torch.ops.aten
FT = torch._subclasses.functional_tensor.FunctionalTensor
out = {"has_defaults": {aten.detach.default, torch.ops.prim.device.default} <= SAC_IGNORED_OPS
                        and set(FT.metadata_fns) <= SAC_IGNORED_OPS,
       "is_torch_2_4_own": SAC_IGNORED_OPS is getattr(cp, "_ignored_ops", None)}

def asked(contexts):
    seen = set()
    def policy(ctx, func, *args, **kwargs):
        seen.add(str(func))
        return cp.CheckpointPolicy.PREFER_RECOMPUTE
    x = torch.linspace(0, 1, 4, dtype=torch.float64, requires_grad=True)
    y = cp.checkpoint(lambda t: t.sin().exp().sum(), x, use_reentrant=False,
                      context_fn=lambda: contexts(policy))
    g, = torch.autograd.grad(y, x)
    return sorted(seen), torch.allclose(g, x.detach().cos() * x.detach().sin().exp(), rtol=1e-12)

def public(policy):
    return cp.create_selective_checkpoint_contexts(policy)

def private(policy):  # torch 2.4's own SAC
    return cp._pt2_selective_checkpoint_context_fn_gen(
        lambda mode, func, *a, **k: policy(None, func) == cp.CheckpointPolicy.MUST_SAVE)

out["before"] = asked(public)
SAC_IGNORED_OPS.add(aten.sin.default)
out["after"] = asked(public)
out["after_private"] = asked(private) if hasattr(cp, "_ignored_ops") else None
SAC_IGNORED_OPS.discard(aten.sin.default)
print(json.dumps(out))
"""


@where_patch_applies("sac-ignored-ops")
def test_native_import_error():
    proc = run_py("from torch.utils.checkpoint import SAC_IGNORED_OPS")
    assert "ImportError: cannot import name 'SAC_IGNORED_OPS'" in proc.stderr, proc.stderr[-2000:]


@through_patch_range("sac-ignored-ops")
def test_ignored_ops_are_not_put_to_the_policy():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["has_defaults"] is True
    assert out["before"][1] is True and "aten.sin.default" in out["before"][0]
    assert out["after"][1] is True and "aten.sin.default" not in out["after"][0]
    assert "aten.exp.default" in out["after"][0]
    if out["is_torch_2_4_own"]:
        assert out["after_private"][1] is True and "aten.sin.default" not in out["after_private"][0]
