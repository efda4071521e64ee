"""dtensor-debug: ``torch.distributed.tensor.debug`` and ``torch.distributed.tensor.device_mesh`` on
torch 2.4, on 2 real ranks (gloo, CPU mesh).

The same rank script runs with TORCHPATCH=1 on torch 2.4 (served) and 2.15 (torch's own, the
reference for the served semantics). ``visualize_sharding`` is checked through a stand-in ``tabulate``
module that hands back the table it is given (the matrix venvs have no ``tabulate``), and without it.
"""

import os

from conftest import (
    DTENSOR_RANK_SETUP, LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, ranks_result, run_json, run_py,
    through_patch_range, where_patch_applies
)

# A stand-in for the tabulate package: the table it is asked for, as JSON.
TABULATE = """
import json
def tabulate(matrix, headers, showindex):
    return json.dumps({"matrix": matrix, "headers": list(headers), "index": list(showindex)})
"""

SCRIPT = DTENSOR_RANK_SETUP + """
import contextlib, io, sys
from torch.distributed.tensor.debug import CommDebugMode, visualize_sharding
from torch.distributed.tensor.device_mesh import DeviceMesh as MeshClass, init_device_mesh as mesh_init
import torch.distributed.device_mesh as device_mesh

out = {"device_mesh": [MeshClass is device_mesh.DeviceMesh, mesh_init is device_mesh.init_device_mesh]}
sharded = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
with CommDebugMode() as comm:
    sharded.redistribute(mesh, [Replicate()])
out["comm"] = {"total": comm.get_total_counts(),
               "ops": sorted(str(op).split(".")[-1] for op, n in comm.get_comm_counts().items() if n)}

def printed(tensor, placements):
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        visualize_sharding(distribute_tensor(tensor, mesh, placements), header="a header")
    return [json.loads(line) if line.startswith("{") else line for line in text.getvalue().splitlines()]

g = torch.arange(24.0).reshape(4, 6)
tables = {"rows": [Shard(0)], "cols": [Shard(1)], "replicated": [Replicate()]}
out["tables"] = {name: printed(g, placements) for name, placements in tables.items()}
out["tables"]["1d_uneven"] = printed(torch.arange(5.0), [Shard(0)])
out["tables"]["empty"] = printed(torch.zeros(0, 3), [Shard(0)])
try:
    printed(torch.zeros(2, 2, 2), [Shard(0)])
except RuntimeError as exc:
    out["3d"] = str(exc)
sys.modules["tabulate"] = None  # as if it were not installed
try:
    out["no_tabulate"] = printed(g, [Shard(0)])
except ValueError as exc:
    out["no_tabulate"] = str(exc)
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print("%s" + json.dumps(gathered), flush=True)
""" % RESULT + LEAVE_WITHOUT_TEARDOWN


def _table(rows, cols, matrix):
    return [{"matrix": matrix, "headers": [f"Col {a}-{b}" for a, b in cols], "index": [f"Row {a}-{b}" for a, b in rows]}]


@through_patch_range("dtensor-debug", "torch 2.5 has them natively")
def test_debug_and_device_mesh_on_two_ranks(tmp_path):
    (tmp_path / "stand_in").mkdir()
    (tmp_path / "stand_in" / "tabulate.py").write_text(TABULATE)
    path = os.pathsep.join([str(tmp_path / "stand_in")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    first, second = ranks_result(SCRIPT, env=clean_env(TORCHPATCH="1", PYTHONPATH=path), tmp_path=tmp_path)
    for rank in (first, second):
        assert rank["device_mesh"] == [True, True]
        assert rank["comm"] == {"total": 1, "ops": ["all_gather_into_tensor"]}
        assert rank["3d"] == "visualize sharding supports only 1D or 2D DTensor"
    assert first["tables"] == {  # printed once, on the rank at coordinate 0
        "rows": _table([(0, 1), (2, 3)], [(0, 5)], [["cpu:0"], ["cpu:1"]]),
        "cols": _table([(0, 3)], [(0, 2), (3, 5)], [["cpu:0", "cpu:1"]]),
        "replicated": _table([(0, 3)], [(0, 5)], [["cpu:0,1"]]),
        "1d_uneven": _table([(0, 2), (3, 4)], [(0, 0)], [["cpu:0"], ["cpu:1"]]),
        "empty": [],
    }
    assert first["no_tabulate"] == "`visualize_sharding` requires either `rich` or `tabulate`."
    assert second["tables"] == {name: [] for name in ("rows", "cols", "replicated", "1d_uneven", "empty")}
    assert second["no_tabulate"] == []


@where_patch_applies("dtensor-debug", "torch 2.5 made them public")
def test_native_failure_and_same_objects_as_private():
    for module in ("debug", "device_mesh"):
        proc = run_py(f"import torch.distributed.tensor.{module}")
        assert f"ModuleNotFoundError: No module named 'torch.distributed.tensor.{module}'" in proc.stderr, proc.stderr[-2000:]
    out = run_json(
        """
        import json, torchpatch
        import torch.distributed.tensor.debug as debug, torch.distributed._tensor.debug as private
        import torch.distributed.tensor.device_mesh as public_mesh, torch.distributed._tensor.device_mesh as private_mesh
        print(json.dumps({"comm": debug.CommDebugMode is private.CommDebugMode, "all": debug.__all__,
                          "mesh": public_mesh is private_mesh, "status": torchpatch.status().get("dtensor-debug")}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out == {"comm": True, "all": ["CommDebugMode", "visualize_sharding"], "mesh": True, "status": "applied"}


@only_torch(">=2.5")
def test_inactive_where_torch_has_them():
    out = run_json(
        """
        import json, torchpatch
        import torch.distributed.tensor.debug as debug, torch.distributed.tensor.device_mesh as mesh
        print(json.dumps([getattr(debug, "__torchpatch__", None), getattr(mesh, "__torchpatch__", None),
                          debug.visualize_sharding.__code__.co_filename.endswith("_visualize_sharding.py")]))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out == [None, None, True]

