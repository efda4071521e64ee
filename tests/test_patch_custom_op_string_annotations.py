"""custom-op-string-annotations: ``torch.library.custom_op`` on a function whose annotations are strings
(``from __future__ import annotations``, as the spmd_types package writes them), torch 2.4.

Natively 2.4 raises ``ValueError: infer_schema(func): Parameter x has unsupported type torch.Tensor``.
With the patch the op is defined and its schema, its values and its gradient (``register_autograd``)
are what torch 2.15 gives natively for the same module (run in its venv by the same test); an
annotation that is not a type raises 2.15's ``ValueError``.
"""

from conftest import clean_env, run_json, run_newest_torch_json, run_py, where_patch_applies

SCRIPT = '''
from __future__ import annotations
import json, typing
import torch

@torch.library.custom_op("tp_test::scaled", mutates_args=())
def scaled(x: torch.Tensor, factor: float, bias: typing.Optional[torch.Tensor] = None) -> torch.Tensor:
    return x * factor if bias is None else x * factor + bias

@scaled.register_fake
def _(x, factor, bias=None):
    return torch.empty_like(x)

def setup(ctx, inputs, output):
    ctx.factor = inputs[1]

scaled.register_autograd(lambda ctx, grad: (grad * ctx.factor, None, None), setup_context=setup)
x = torch.arange(4.0, requires_grad=True)
y = scaled(x, 3.0, torch.ones(4))
y.sum().backward()
try:
    @torch.library.custom_op("tp_test::bad", mutates_args=())
    def bad(x: NotAType) -> torch.Tensor:
        return x
    error = ""
except ValueError as exc:
    error = str(exc).split(" Got func")[0]
print(json.dumps({"schema": str(scaled._opoverload._schema), "y": y.tolist(), "grad": x.grad.tolist(), "error": error}))
'''


@where_patch_applies("custom-op-string-annotations", "torch 2.5 evaluates string annotations")
def test_native_value_error():
    proc = run_py(SCRIPT)
    assert "has unsupported type torch.Tensor" in proc.stderr, proc.stderr[-2000:]


@where_patch_applies("custom-op-string-annotations")
def test_string_annotations_as_on_the_newest_torch():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out == run_newest_torch_json(SCRIPT)
    assert out["grad"] == [3.0] * 4 and "Unsupported type annotation NotAType" in out["error"], out
