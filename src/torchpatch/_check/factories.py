"""What torch's factories return (``patches/_data/factories.json``, catalogue data: the engine itself knows no
torch API): the table that lets ``torchpatch check`` know the torch class of a value the code makes,
so that the members it uses on that value can be checked. The file's ``_doc`` says how keys read.
"""

from __future__ import annotations

import json
from typing import Dict, FrozenSet

from .._registry import catalogue_data

RETURNS: Dict[str, str] = json.loads((catalogue_data() / "factories.json").read_text())["returns"]

# Functions whose calls make torch values: the scanner looks for their names where they are imported.
FUNCTIONS: FrozenSet[str] = frozenset(key[:-2] for key in RETURNS if key.endswith("()") and "." not in key)
