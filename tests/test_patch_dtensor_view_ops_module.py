"""dtensor-view-ops-module: ``torch.distributed.tensor._ops._view_ops``' view decomposition on torch 2.4.

Natively 2.4 has no ``torch.distributed.tensor._ops`` (``ModuleNotFoundError``, which stops the spmd_types
package). With the patch ``view_groups`` and ``infer_size`` decompose views (split, flatten, both, a
singleton, an inferred -1) into the same ``DimSpec`` trees as torch 2.15's (its venv, the same test,
compared by their reprs).
"""

from conftest import clean_env, run_json, run_newest_torch_json, run_py, where_patch_applies

SCRIPT = '''
import json
from torch.distributed.tensor._ops._view_ops import InputDim, Split, infer_size, view_groups
shapes = [((6, 4), (2, 3, 4)), ((2, 3, 4), (6, 4)), ((2, 6), (4, 3)), ((1, 6, 1), (6,)), ((4, 6), (24,))]
out = {"groups": [repr(view_groups(a, b)) for a, b in shapes], "infer": list(infer_size(24, (2, -1, 3))),
       "kinds": [InputDim.__name__, Split.__name__]}
print(json.dumps(out))
'''


@where_patch_applies("dtensor-view-ops-module", "torch 2.5 moved the module")
def test_native_module_not_found():
    proc = run_py(SCRIPT)
    assert "No module named 'torch.distributed.tensor._ops'" in proc.stderr, proc.stderr[-2000:]


@where_patch_applies("dtensor-view-ops-module")
def test_view_decomposition_as_on_the_newest_torch():
    assert run_json(SCRIPT, env=clean_env(TORCHPATCH="1")) == run_newest_torch_json(SCRIPT)
