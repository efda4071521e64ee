"""inductor-wrap-compiled-regions: ``torch.compile(options={"wrap_inductor_compiled_regions": True})``
compiles on torch 2.0 to 2.9 as on torch >= 2.10: the function computes the same values outside and
inside selective activation checkpointing (the mode the key is for), checked against a float64 eager
reference; a value that is not a ``bool`` is torch's own type error."""

from conftest import clean_env, patch_applies_here, run_json, run_py, through_patch_range, where_patch_applies

USE = """
import json, torch
from functools import partial
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

def f(x, w):
    return torch.sin(x @ w).sum(0)

compiled = torch.compile(f, options={"wrap_inductor_compiled_regions": True, "max_autotune": False})
policy = lambda ctx, op, *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE
x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
w = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), requires_grad=True)
ref_w = w.detach().double().requires_grad_()
ref = f(x.double(), ref_w)
ref.sum().backward()
plain = compiled(x, w.detach())
sac = checkpoint(compiled, x, w, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, policy))
sac.sum().backward()
close = lambda a, b: torch.allclose(a.double(), b, rtol=1e-5, atol=1e-6)
out = {"plain": close(plain, ref), "sac": close(sac.detach(), ref.detach()), "grad": close(w.grad, ref_w.grad)}
try:
    torch.compile(f, options={"wrap_inductor_compiled_regions": 1})
except RuntimeError as exc:
    out["not_bool"] = str(exc)
import torchpatch
out["status"] = torchpatch.status().get("inductor-wrap-compiled-regions")
print(json.dumps(out))
"""


@where_patch_applies("inductor-wrap-compiled-regions", "the Inductor key came with torch 2.10")
def test_native_failure():
    proc = run_py("import torch; torch.compile(lambda x: x, options={'wrap_inductor_compiled_regions': True})",
                  env=clean_env())
    assert "Unexpected optimization option wrap_inductor_compiled_regions" in proc.stderr, proc.stderr


@through_patch_range("inductor-wrap-compiled-regions", since="2.4")
def test_compiles_with_the_key():
    out = run_json(USE, env=clean_env(TORCHPATCH="1"), timeout=600)
    assert out["plain"] and out["sac"] and out["grad"], out
    assert out["not_bool"] == "Unexpected type of attr wrap_inductor_compiled_regions, got int should be bool"
    assert out["status"] == ("applied" if patch_applies_here("inductor-wrap-compiled-regions") else None)
