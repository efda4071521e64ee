"""compile-shapes-spec: on torch >= 2.14, ``torch.compile(shapes_spec=...)`` (torch 2.13's spelling)
compiles exactly as ``torch.compile(dynamic_shapes=...)`` does on the same torch: same results, same
graphs handed to the backend, in both the call and the decorator form."""

from conftest import clean_env, only_torch, run_json, run_py, where_patch_applies

USE = """
import inspect, json, torch
from torch.fx.experimental.dynamic_spec import ShapeVar, TensorSpec

def compile_with(kw):
    graphs = []
    def backend(gm, example_inputs):
        graphs.append([[str(s) for s in t.shape] for t in example_inputs if isinstance(t, torch.Tensor)])
        return gm.forward
    spec = {"x": TensorSpec([ShapeVar("batch"), None])}
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x * 2).sum(0), backend=backend, **{kw: spec})
    @torch.compile(backend=backend, **{kw: spec})
    def g(x):
        return x.cumsum(0)
    outs = [f(torch.arange(n * 3.0).reshape(n, 3)).tolist() + g(torch.ones(n, 3)).tolist() for n in (2, 5, 9)]
    return {"outs": outs, "graphs": graphs}

out = {"old": compile_with("shapes_spec")}
if "dynamic_shapes" in inspect.signature(torch.compile).parameters:  # the current spelling, as reference
    out["new"] = compile_with("dynamic_shapes")
    try:
        torch.compile(lambda x: x, shapes_spec={}, dynamic_shapes={})
    except TypeError as exc:
        out["both"] = str(exc)
import torchpatch
out["status"] = torchpatch.status().get("compile-shapes-spec")
print(json.dumps(out))
"""


@where_patch_applies("compile-shapes-spec", "torch 2.14 renamed shapes_spec to dynamic_shapes")
def test_native_failure():
    proc = run_py("import torch; torch.compile(lambda x: x, shapes_spec={})", env=clean_env())
    assert "unexpected keyword argument 'shapes_spec'" in proc.stderr, proc.stderr


@where_patch_applies("compile-shapes-spec")
def test_served_as_dynamic_shapes():
    out = run_json(USE, env=clean_env(TORCHPATCH="1"))
    assert out["status"] == "applied"
    assert out["old"] == out["new"] and out["old"]["graphs"]
    assert out["both"].startswith("torch.compile() got both shapes_spec")


@only_torch(">=2.13,<2.14", "torch 2.13's own shapes_spec")
def test_inactive_where_torch_has_it():
    out = run_json(USE, env=clean_env(TORCHPATCH="1"))
    assert out["status"] is None and "both" not in out  # out of its torch range: not even armed
