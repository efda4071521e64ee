"""Which patches apply to the installed torch and Python, and which the flags switch on."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Mapping, Optional, Tuple

from . import _versions
from ._config import Config, Decision, decide
from ._patch import Patch
from ._registry import all_patches, applicable_builtin_patches, with_plugins


@dataclass
class PatchPlan:
    """A patch, whether it applies to this torch and Python, and whether the flags have it on."""

    patch: Patch
    applies: bool
    applies_reason: str
    decision: Decision

    @property
    def active(self) -> bool:
        return self.applies and self.decision.enabled


def applicability(torch: str, python: str, torch_version: Optional[str]) -> Tuple[bool, str]:
    """Whether a patch for ``torch`` (and ``python``) specifiers applies here, and why."""
    if torch_version is None:
        return False, "torch is not installed"
    if not _versions.matches(torch, torch_version):
        return False, f"for torch {torch}"
    if python and not _versions.matches(python, _versions.python_version()):
        return False, f"for Python {python}"
    return True, f"torch {torch}" + (f", Python {python}" if python else "")


def plan(environ: Optional[Mapping[str, str]] = None, cfg: Optional[Config] = None, *,
         only_applicable: bool = False) -> List[PatchPlan]:
    """Every known patch with its applicability and on/off decision, for the installed torch.

    ``only_applicable`` (what :func:`~torchpatch.install` uses): built-in patches that cannot apply
    to the installed torch and Python are left out, their modules not even imported (the
    catalogue's index says which); the flags may still name them.
    """
    cfg = cfg or Config.from_environ(os.environ if environ is None else environ)
    version = _versions.torch_version()
    if only_applicable:
        builtin, left_out = applicable_builtin_patches(lambda torch, python: applicability(torch, python, version)[0])
        patches = with_plugins(builtin, cfg.strict, taken=left_out)
    else:
        patches, left_out = all_patches(cfg.strict), []
    applicabilities = {p.id: applicability(p.torch, p.python, version) for p in patches}
    inapplicable = {i for i, (applies, _) in applicabilities.items() if not applies}
    decisions = decide(cfg, patches, inapplicable.union(left_out), left_out)
    return [PatchPlan(p, *applicabilities[p.id], decisions[p.id]) for p in patches]
