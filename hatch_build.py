"""The wheel's build hook: what an editable install (``pip install -e .``) copies into site-packages.

The wheel force-includes torchpatch's start-up files at its root (``[tool.hatch.build.targets.wheel.force-include]``).
An editable install puts ``src/`` on ``sys.path`` instead of copying the package; of those files it copies
only the ones Python's ``site`` reads from site-packages itself (``torchpatch.pth``, ``torchpatch.start``).
The start-up module ``_torchpatch_startup`` is then imported from ``src/`` like the package, so an edit to it
is seen at the next start, not shadowed by a copy made at install time. This uses hatchling's documented
``force_include_editable`` build data, which replaces ``force-include`` for the editable wheel only.
"""

import os
from typing import Any, Dict

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

# What site-packages must hold for the interpreter to run torchpatch's start-up hook (PEP 829's .start, a .pth).
SITE_FILES = (".pth", ".start")


class EditableStartupHook(BuildHookInterface):
    """Copies only the site files into an editable install; the modules stay in the working tree."""

    def initialize(self, version: str, build_data: Dict[str, Any]) -> None:
        if version == "editable":
            build_data["force_include_editable"] = {
                source: target for source, target in self.build_config.force_include.items()
                if os.path.splitext(target)[1] in SITE_FILES
            }
