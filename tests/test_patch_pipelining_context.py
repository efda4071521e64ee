"""pipelining-context: torch 2.10's ``_PipelineContext`` on torch 2.4-2.9.

Without torchpatch the import fails. With it (and natively on torch >= 2.10) the same script checks
torch 2.15's dataclass: its fields in order, their defaults, positional construction as torchtitan's
tests build it, equality by value; where torch has it the patch is not armed.
"""

from conftest import clean_env, only_torch, run_json, run_py, through_patch_range, where_patch_applies


@where_patch_applies("pipelining-context", "torch 2.10 added it")
def test_native_import_error():
    proc = run_py("from torch.distributed.pipelining.schedules import _PipelineContext")
    assert "ImportError: cannot import name '_PipelineContext'" in proc.stderr, proc.stderr[-2000:]


SCRIPT = """
import dataclasses, json, types
from torch.distributed.pipelining.schedules import _PipelineContext
schedule = types.SimpleNamespace()
ctx = _PipelineContext(schedule, [(1,)], [{}], None, [])
out = {"module": _PipelineContext.__module__,
       "fields": [f.name for f in dataclasses.fields(_PipelineContext)],
       "defaults": [getattr(_PipelineContext(schedule), f.name) for f in dataclasses.fields(_PipelineContext)[1:]],
       "values": [ctx.schedule_ref is schedule, ctx.arg_mbs, ctx.kwarg_mbs, ctx.target_mbs, list(ctx.losses)],
       "equal": ctx == _PipelineContext(schedule, arg_mbs=[(1,)], kwarg_mbs=[{}], losses=[])}
ctx.losses.append(2)
out["mutable"] = ctx.losses
import torchpatch
out["status"] = torchpatch.status().get("pipelining-context")
print(json.dumps(out))
"""


@through_patch_range("pipelining-context", "pipelining came with torch 2.4")
def test_dataclass_as_torch_2_15_defines_it():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["module"] == "torch.distributed.pipelining.schedules"
    assert out["fields"] == ["schedule_ref", "arg_mbs", "kwarg_mbs", "target_mbs", "losses"]
    assert out["defaults"] == [None, None, None, None]
    assert out["values"] == [True, [[1]], [{}], None, []]
    assert out["equal"] is True and out["mutable"] == [2]


@only_torch(">=2.10", "torch has it: nothing is served")
def test_inactive_where_torch_has_it():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["status"] is None
