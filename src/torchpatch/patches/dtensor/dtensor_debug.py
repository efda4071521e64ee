"""dtensor-debug: ``torch.distributed.tensor.debug`` (``CommDebugMode``, ``visualize_sharding``) and
``torch.distributed.tensor.device_mesh``, torch 2.4.

What breaks:   code written for torch >= 2.5 does ``from torch.distributed.tensor.debug import
               CommDebugMode`` (or ``visualize_sharding``; or ``from torch.distributed.tensor.device_mesh
               import init_device_mesh``) and dies with ``ModuleNotFoundError: No module named
               'torch.distributed.tensor.debug'`` (``... 'torch.distributed.tensor.device_mesh'``).
Torch:         2.4 keeps them in the private ``torch.distributed._tensor.debug`` and
               ``torch.distributed._tensor.device_mesh``; 2.5 made them public.
Fix:           serve ``torch.distributed.tensor.device_mesh`` as the very module
               ``torch.distributed._tensor.device_mesh`` (the same ``DeviceMesh`` and
               ``init_device_mesh``), and ``torch.distributed.tensor.debug`` as a module holding 2.4's
               own ``CommDebugMode`` (the same counting of collectives; the tracing-table methods
               later torch added to it, ``generate_comm_debug_tracing_table``,
               ``generate_json_dump``, ``log_comm_debug_tracing_table_to_file``, are not served) and
               ``visualize_sharding(dtensor, header="", use_rich=False)`` with torch 2.15's
               semantics: on the rank at coordinate 0 of every mesh dimension it prints a
               ``tabulate`` table of which devices hold which rows and columns of a 1-D or 2-D
               DTensor (2.4's own prints a differently laid-out table, the header too, and fails on
               1-D tensors). The ``rich`` rendering of ``use_rich=True`` is not served: where ``rich``
               and ``matplotlib`` are installed it raises ``NotImplementedError``.
Upstream:      https://github.com/pytorch/pytorch/pull/133881 (DTensor public, torch 2.5)
"""

from __future__ import annotations

import importlib.util
import itertools
from types import ModuleType
from typing import Any, List, Tuple

from torchpatch import Patch

PATCH = Patch(
    id="dtensor-debug",
    summary="torch.distributed.tensor.debug (CommDebugMode, visualize_sharding) and "
    "torch.distributed.tensor.device_mesh",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/133881",
)

PATCH.alias("torch.distributed.tensor.device_mesh", "torch.distributed._tensor.device_mesh")

Range = Tuple[int, int]


def _shards(dtensor: Any) -> List[Tuple[Range, Range, int]]:
    """(rows, columns, device index) each device of the mesh holds, inclusive ranges; a 1-D tensor
    is one column."""
    from torch.distributed._tensor.debug.visualize_sharding import compute_local_shape_and_global_offset

    mesh = dtensor.device_mesh
    shards = []
    for coordinate in itertools.product(*(range(n) for n in mesh.mesh.shape)):
        shape, offset = compute_local_shape_and_global_offset(dtensor.shape, mesh, dtensor.placements,
                                                              list(coordinate))
        (rows, cols), (row0, col0) = (tuple(shape) + (1,))[:2], (tuple(offset) + (0,))[:2]
        shards.append(((row0, row0 + rows - 1), (col0, col0 + cols - 1), int(mesh.mesh[coordinate])))
    return shards


def _table(shards: List[Tuple[Range, Range, int]], device_kind: str) -> str:
    """A ``tabulate`` table: a row per row range, a column per column range, the devices in each cell."""
    from tabulate import tabulate

    rows, cols = sorted({s[0] for s in shards}), sorted({s[1] for s in shards})
    cells = [[[str(d) for r, c, d in shards if (r, c) == (row, col)] for col in cols] for row in rows]
    matrix = [[device_kind + ":" + ",".join(devices) if devices else "" for devices in line] for line in cells]
    return tabulate(matrix, headers=[f"Col {a}-{b}" for a, b in cols], showindex=[f"Row {a}-{b}" for a, b in rows])


def visualize_sharding(dtensor: Any, header: str = "", use_rich: bool = False) -> None:
    """Print which devices hold which part of a 1-D or 2-D DTensor, once per mesh, on the rank whose
    coordinate is 0 on every mesh dimension (torch 2.15's ``visualize_sharding``; needs ``tabulate``).
    Nothing is printed for an empty DTensor or on a rank outside the mesh."""
    if dtensor.numel() == 0:
        return
    if len(dtensor.shape) >= 3:
        raise RuntimeError("visualize sharding supports only 1D or 2D DTensor")
    mesh = dtensor.device_mesh
    if mesh.get_coordinate() is None or any(mesh.get_local_rank(mesh_dim=d) != 0 for d in range(mesh.ndim)):
        return
    shards = _shards(dtensor)
    if use_rich and importlib.util.find_spec("rich") and importlib.util.find_spec("matplotlib"):
        raise NotImplementedError("visualize_sharding(use_rich=True) on torch 2.4 (served by torchpatch) "
                                  "does not draw rich tables; use_rich=False prints the tabulate table")
    if not importlib.util.find_spec("tabulate"):
        raise ValueError("`visualize_sharding` requires either `rich` or `tabulate`.")
    print(_table(shards, mesh.device_type))


PATCH.sets("torch.distributed.tensor.debug", ("CommDebugMode", "visualize_sharding"))


@PATCH.module("torch.distributed.tensor.debug")
def build(module: ModuleType) -> None:
    from torch.distributed._tensor.debug import CommDebugMode

    module.CommDebugMode = CommDebugMode
    module.visualize_sharding = visualize_sharding
    module.__all__ = ["CommDebugMode", "visualize_sharding"]
