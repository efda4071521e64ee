"""inductor-compiled-code-hop: torch 2.10's ``inductor_compiled_code`` operator on torch 2.4-2.9.

Without torchpatch the name is missing. With it (and natively on torch >= 2.10) the same script
checks the operator torch 2.15 defines: one object in ``_higher_order_ops`` and its ``wrap`` module,
named ``inductor_compiled_code``; called on a compiled callable it returns what the callable returns,
and autograd passes through it (gradients equal to those of the callable called directly).
"""

from conftest import clean_env, run_json, run_py, through_patch_range, where_patch_applies


@where_patch_applies("inductor-compiled-code-hop", "torch 2.10 added it")
def test_native_attribute_error():
    proc = run_py("import torch._higher_order_ops as hop; hop.inductor_compiled_code")
    assert "has no attribute 'inductor_compiled_code'" in proc.stderr, proc.stderr[-2000:]


SCRIPT = """
import json, types, torch
import torch._higher_order_ops as hop
from torch._higher_order_ops import wrap

def compiled(inputs):
    x, w = inputs
    return [torch.tanh(x @ w), (x * 3).sum()]

holder = wrap.InductorCompiledCallable(compiled) if hasattr(wrap, "InductorCompiledCallable") else \\
    types.SimpleNamespace(compiled_callable=compiled)
x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
w = torch.randn(4, 2, generator=torch.Generator().manual_seed(1), requires_grad=True)
ref_w = w.detach().clone().requires_grad_()
got = hop.inductor_compiled_code(holder, [x, w])
ref = compiled([x, ref_w])
got[0].sum().backward()
ref[0].sum().backward()
import torchpatch
print(json.dumps({"same": hop.inductor_compiled_code is wrap.inductor_compiled_code,
                  "name": hop.inductor_compiled_code.name(),
                  "values": all(torch.equal(a, b) for a, b in zip(got, ref)),
                  "grad": torch.equal(w.grad, ref_w.grad),
                  "status": torchpatch.status().get("inductor-compiled-code-hop")}))
"""


@through_patch_range("inductor-compiled-code-hop")
def test_operator_as_torch_2_15_runs_it():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["same"] and out["name"] == "inductor_compiled_code"
    assert out["values"] and out["grad"], out
