"""pipelining-dualpipev-overlap: ``OVERLAP_F_B`` and ``_wait_batch_p2p`` in
``torch.distributed.pipelining.schedules`` on torch 2.4 (2.9 added them). Served and from 2.9 natively:
both import (what torchtitan 0.2.2 does at module level), ``OVERLAP_F_B`` is a ``_ComputationType`` member of that name and
``_wait_batch_p2p`` waits for each work of a list. Natively on 2.4 the import fails."""

from conftest import clean_env, run_json, run_py, through_patch_range, where_patch_applies

SCRIPT = """
import json
from torch.distributed.pipelining.schedules import OVERLAP_F_B, _wait_batch_p2p

class Work:
    waited = 0
    def wait(self):
        Work.waited += 1

_wait_batch_p2p([Work(), Work(), Work()])
print(json.dumps({"name": OVERLAP_F_B.name, "type": type(OVERLAP_F_B).__name__, "waited": Work.waited}))
"""


@where_patch_applies("pipelining-dualpipev-overlap", "torch 2.9 added them")
def test_native_import_fails():
    proc = run_py("from torch.distributed.pipelining.schedules import OVERLAP_F_B\n", env=clean_env())
    assert "cannot import name 'OVERLAP_F_B'" in proc.stderr, proc.stderr[-2000:]


@through_patch_range("pipelining-dualpipev-overlap", "torch's own from 2.9")
def test_names_as_torch_29():
    assert run_json(SCRIPT, env=clean_env(TORCHPATCH="1")) == {"name": "OVERLAP_F_B", "type": "_ComputationType", "waited": 3}
