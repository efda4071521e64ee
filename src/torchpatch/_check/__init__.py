"""``torchpatch check``: a static pre-flight scan of a repository's torch names against one torch.

Every ``.py`` file is parsed (never executed). The scan collects each torch name the code uses
(``import torch.x.y``, ``from torch.x import a``, attribute chains on imported torch modules,
``torch.ops.<ns>.<op>``), the members used on values whose torch class the code makes evident and
the calls of torch classes, together with the import guards around them, and resolves each on the
target torch: natively, through a patch of the catalogue (its module shims, aliases and symbols,
as data), or not at all. Nothing here knows particular torch APIs: what factories return is catalogue
data (``patches/_data/factories.json``), what exists comes from the inventories in ``patches/_data/inventory``
(``tools/inventory.py``) or, for the installed torch, from a helper interpreter that imports torch
once; what torchpatch serves comes from the patches' declarations; features that cannot be
backported from ``patches/_data/not_backportable.json``.

One job per module: :mod:`.inventory` (the inventories), :mod:`.helper` (the helper program) and
:mod:`.live` (talking to it), :mod:`.serving` and :mod:`.resolve` (names), :mod:`.factories`,
:mod:`.signature` and :mod:`.members` (members and constructor calls), :mod:`.guards` and
:mod:`.scan` (the AST scan), :mod:`.report` (rows and text), :mod:`.target` (which torch),
:mod:`.progress` (the status line on a terminal). :mod:`.explain` (``torchpatch explain``) asks the
same machinery about one name.
"""

from .base import KINDS, CheckError, not_backportable, not_backportable_for
from .inventory import inventory_files
from .progress import Progress
from .report import check, exists_in, format_text, only_problems
from .scan import python_files
from .target import Target, choose_target

__all__ = ["KINDS", "CheckError", "Progress", "Target", "check", "choose_target", "exists_in", "format_text",
           "inventory_files", "not_backportable", "not_backportable_for", "only_problems", "python_files"]
