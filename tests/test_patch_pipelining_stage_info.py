"""pipelining-stage-info: torch 2.15's ``PipelineStageInfo`` on torch 2.4-2.14.

Without torchpatch the import fails. With it (and natively on 2.15) the same script checks 2.15's
documented value: keyword-only construction, ``is_metadata_inference`` defaulting to False, frozen,
equal and hashable by value, one object in ``stage`` and in the package; on 2.15 the patch is not
armed.
"""

from conftest import clean_env, only_torch, run_json, run_py, through_patch_range, where_patch_applies


@where_patch_applies("pipelining-stage-info", "torch 2.4-2.14 have pipelining without it")
def test_native_import_error():
    proc = run_py("from torch.distributed.pipelining import PipelineStageInfo")
    assert "ImportError: cannot import name 'PipelineStageInfo'" in proc.stderr, proc.stderr[-2000:]


SCRIPT = """
import dataclasses, json, torch.distributed.pipelining as pipelining
from torch.distributed.pipelining.stage import PipelineStageInfo
info = PipelineStageInfo(stage_index=3, microbatch_index=1)
out = {"same": pipelining.PipelineStageInfo is PipelineStageInfo,
       "module": PipelineStageInfo.__module__,
       "fields": [f.name for f in dataclasses.fields(PipelineStageInfo)],
       "values": [info.stage_index, info.microbatch_index, info.is_metadata_inference],
       "equal": info == PipelineStageInfo(stage_index=3, microbatch_index=1, is_metadata_inference=False),
       "hash": hash(info) == hash(PipelineStageInfo(stage_index=3, microbatch_index=1)),
       "differs": info != PipelineStageInfo(stage_index=3, microbatch_index=1, is_metadata_inference=True),
       "replace": dataclasses.replace(info, microbatch_index=2).microbatch_index}
try:
    info.stage_index = 0
except dataclasses.FrozenInstanceError:
    out["frozen"] = True
try:
    PipelineStageInfo(3, 1)
    out["positional"] = "accepted"
except TypeError:
    out["positional"] = "TypeError"
import torchpatch
out["status"] = torchpatch.status().get("pipelining-stage-info")
print(json.dumps(out))
"""


@through_patch_range("pipelining-stage-info", "pipelining came with torch 2.4")
def test_value_as_torch_2_15_documents_it():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["same"] is True and out["module"] == "torch.distributed.pipelining.stage"
    assert out["fields"] == ["stage_index", "microbatch_index", "is_metadata_inference"]
    assert out["values"] == [3, 1, False]
    assert out["equal"] and out["hash"] and out["differs"] and out["frozen"] and out["replace"] == 2
    assert out["positional"] == "TypeError"  # keyword-only (Python >= 3.10, as the matrix's)


@only_torch(">=2.15", "torch has it: nothing is served")
def test_inactive_where_torch_has_it():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["status"] is None
