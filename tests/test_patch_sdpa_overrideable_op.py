"""sdpa-overrideable-op: ``torch.ops.aten._scaled_dot_product_fused_attention_overrideable`` on torch 2.4
(torch 2.5 added it). Served and from 2.5 natively: the operator exists with torch 2.15's schema (read
from 2.15's venv in the same test) and calling it on CPU tensors raises ``NotImplementedError`` (no
in-tree backend implements it); torchtitan 0.2.2 only names it in its activation checkpointing's save
list. Natively on 2.4 the name is an ``AttributeError``."""

from conftest import clean_env, run_json, run_newest_torch_json, through_patch_range, where_patch_applies

SCRIPT = """
import json, torch
try:
    op = torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default
except AttributeError:
    print(json.dumps({"missing": True}))
    raise SystemExit
q = torch.randn(1, 2, 3, 4)
try:
    op(q, q, q)
    error = None
except NotImplementedError as exc:
    error = str(exc)
print(json.dumps({"schema": str(op._schema), "error": error}))
"""


@where_patch_applies("sdpa-overrideable-op", "torch 2.5 added the operator")
def test_native_missing():
    assert run_json(SCRIPT, env=clean_env()) == {"missing": True}


@through_patch_range("sdpa-overrideable-op", "torch's own operator from 2.5")
def test_operator_as_the_newest_torch_has_it():
    here = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    newest = run_newest_torch_json(SCRIPT)
    assert here["schema"] == newest["schema"]
    assert here["error"] is not None and "_scaled_dot_product_fused_attention_overrideable not implemented" in here["error"]
