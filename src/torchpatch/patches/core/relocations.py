"""relocations: torch.distributed modules that moved, served under their other name, torch 2.1 and
later.

What breaks:   code written for one torch imports a distributed module by the path of its torch:
               ``import torch.distributed._tensor.ops.view_ops`` on 2.9+ (now
               ``torch.distributed.tensor._ops._view_ops``), ``torch.distributed.tensor._redistribute``
               on 2.4 (then ``torch.distributed._tensor._redistribute``), ... and dies with
               ``ModuleNotFoundError``.
Torch:         2.1 and later; each entry of ``_data/relocations.json`` names the versions it applies to.
Fix:           where a path is missing and its counterpart exists, serve the very same module
               object under the missing path. The table is derived from inventories of every
               matrix torch (tools/inventory.py, tools/relocations.py): an entry is a relocation
               when the two modules define the same classes and functions under the same qualified
               names; where a public function's call signature changed between the two, the entry
               is listed with ``"alias": false`` and the reason, and not served (an alias would
               hand old callers a function that no longer takes their arguments).
Upstream:      https://github.com/pytorch/pytorch/pull/133881 (DTensor made public as
               torch.distributed.tensor, with a shim for the old paths that covers only some) and
               https://github.com/pytorch/pytorch/pull/127339 (DTensor modules made private)
"""

import json
from pathlib import Path

from torchpatch import Patch

PATCH = Patch(
    id="relocations",
    summary="torch.distributed modules that moved between versions, served under their other path",
    torch=">=2.1",
    upstream="https://github.com/pytorch/pytorch/pull/133881",
)

TABLE = json.loads((Path(__file__).parent.parent / "_data" / "relocations.json").read_text())

for _entry in TABLE:
    if _entry["alias"]:
        PATCH.alias(_entry["name"], _entry["target"], torch=_entry["torch"])
