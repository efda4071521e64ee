"""``torchpatch doctor``: the environment report, its hazards, and its exit status.

Exit status: :data:`OK` when nothing is wrong, :data:`HAZARD` when something will bite (numpy 2
beside a torch built against numpy 1, two copies of torchpatch, ``TORCHPATCH`` on but the start-up
hook never ran), :data:`MISSING` when a run-time dependency of torchpatch is absent.
"""

from __future__ import annotations

import importlib.util
import os
import site
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import _torchpatch_startup
from _torchpatch_startup import parse_flag

from . import _versions
from ._config import Config, shown
from ._known_bugs import known_bugs_for
from ._patch import Patch
from ._plan import PatchPlan, plan
from ._version import __version__

OK, HAZARD, MISSING = 0, 1, 3
DEPENDENCIES = {"wrapt": "wrapt>=1.14", "packaging": "packaging>=21"}  # as pyproject.toml requires them
HOW_TO_TELL = (
    "a process in which torchpatch activated prints one line when it exits (`torchpatch: "
    f"{__version__} on torch ...: applied ...`, from rank 0 of a job; TORCHPATCH_LOG=off hides it): "
    "no such line means torchpatch did not act there. In code: torchpatch.is_installed() (true once "
    "activated, or while armed and waiting for `import torch`) and torchpatch.status() (each armed "
    "patch: applied, not needed, failed, waiting)"
)
NO_HOOK_FIX = ("use `torchpatch run -- CMD`, or put the package's _bootstrap/sitecustomize.py on PYTHONPATH as "
               "sitecustomize.py (docs/usage/clusters.md)")
EXIT_CODES = f"""\
Exit status: {OK} when nothing is wrong; {HAZARD} when a hazard is found (numpy 2 beside a torch built for
numpy 1, two installed copies of torchpatch, TORCHPATCH on but the start-up hook did not run in this
process); {MISSING} when a run-time dependency of torchpatch (wrapt, packaging) is missing: torchpatch
cannot patch here. Warnings (an untested torch, unknown flags) and silent torch bugs do not change it.
"""


def _metadata() -> Any:
    if sys.version_info >= (3, 10):
        from importlib import metadata
    else:
        import importlib_metadata as metadata
    return metadata


def _dist_version(name: str) -> Optional[str]:
    metadata = _metadata()
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _installed_startup_hooks() -> List[str]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [os.path.join(d, "torchpatch.pth") for d in dirs if os.path.exists(os.path.join(d, "torchpatch.pth"))]


def dependencies() -> Dict[str, Optional[str]]:
    """Each run-time dependency: its installed version, ``"?"`` where it imports without
    distribution metadata, ``None`` where it is missing."""
    found: Dict[str, Optional[str]] = {}
    for name in DEPENDENCIES:
        present = importlib.util.find_spec(name) is not None
        found[name] = (_dist_version(name) or "?") if present else None
    return found


def installed_copies() -> Dict[str, List[str]]:
    """Where torchpatch is installed, as this interpreter's ``sys.path`` sees it: ``packages``, the
    ``torchpatch`` package directories (the one ``import torchpatch`` finds first), and
    ``distributions``, the ``torchpatch-*.dist-info`` directories."""
    packages: List[str] = []
    for entry in sys.path:
        init = os.path.join(entry or os.getcwd(), "torchpatch", "__init__.py")
        if os.path.isfile(init):
            real = os.path.realpath(os.path.dirname(init))
            if real not in packages:
                packages.append(real)
    distributions: List[str] = []
    for dist in _metadata().distributions():
        if (dist.metadata["Name"] or "").lower() == "torchpatch":
            path = os.path.realpath(str(getattr(dist, "_path", dist.locate_file(""))))
            if path not in distributions:
                distributions.append(path)
    return {"packages": packages, "distributions": distributions}


def _hazards(torch: Optional[str]) -> List[str]:
    found = []
    numpy = _dist_version("numpy")
    if torch and numpy and _versions.matches("<2.3", torch) and _versions.matches(">=2", numpy):
        found.append(
            f"numpy {numpy} beside torch {torch}, which was built against numpy 1.x: torch.from_numpy"
            " and friends fail ('_ARRAY_API not found'); install 'numpy<2'"
        )
    return found


def _copies_hazard(copies: Dict[str, List[str]]) -> List[str]:
    packages, dists = copies["packages"], copies["distributions"]
    if len(packages) <= 1 and len(dists) <= 1:
        return []
    where = "; ".join([f"package {p}" + (" (imported)" if i == 0 else " (shadowed)") for i, p in enumerate(packages)]
                      + [f"distribution {d}" for d in dists])
    return [f"{max(len(packages), len(dists))} installed copies of torchpatch ({where}): the start-up hook of one"
            " may load the other, and `pip uninstall` removes one at a time; remove all but one (pip uninstall"
            " torchpatch until none is left, or delete the --target/PYTHONPATH copy), then install once"]


def activation() -> Tuple[bool, str]:
    """Whether ``TORCHPATCH`` turns torchpatch on in this environment, and that in words."""
    value = os.environ.get("TORCHPATCH")
    if value is None:
        return False, "activation is OFF here (TORCHPATCH is not set): nothing is applied"
    if parse_flag(value):
        return True, f"activation is on (TORCHPATCH={shown(value)})"
    return False, f"activation is OFF here (TORCHPATCH={value!r}): nothing is applied"


def _activation() -> Dict[str, Any]:
    """:func:`activation`, and whether the start-up hook ran in this very process: where
    ``TORCHPATCH`` is on and the hook did not run, nothing will be patched."""
    on, text = activation()
    ran = bool(getattr(_torchpatch_startup, "_started", False))
    if on:
        text += (": the start-up hook armed torchpatch in this process" if ran else
                 ", but torchpatch's start-up hook did NOT run in this process")
    return {"on": on, "hook_ran": ran, "text": text}


def _untested(torch: Optional[str], newest: str, plans: List[PatchPlan]) -> List[str]:
    """A warning where ``torch`` is newer than ``newest``, the newest torch the catalogue was tested
    on: every patch that applies to it has an open-ended version range."""
    if not _versions.matches(f">{newest}", torch):
        return []
    applying = ", ".join(p.patch.id for p in plans if p.applies) or "none"
    return [f"torch {torch} is newer than the newest torch this catalogue was tested on ({newest}):"
            f" the patches whose version range is open-ended apply untested ({applying})"]


def _not_backportable(torch: Optional[str], patches: Sequence[Patch] = (), cfg: Optional[Config] = None) -> List[Dict[str, str]]:
    """Features this torch lacks that torchpatch cannot serve (patches/_data/not_backportable.json), less
    those a catalogue patch serves on this torch (switched on or not)."""
    from ._check import not_backportable
    from ._check.serving import Serving

    missing = [e for e in not_backportable() if torch and not _versions.matches(e["torch"], torch)]
    if not missing or not patches:
        return missing
    serving = Serving.for_torch(torch, patches, cfg or Config.from_environ())
    served = set(serving.shims) | set(serving.aliases) | set(serving.off)
    served |= {f"{module}.{name}" for module, name in serving.symbols}
    return [e for e in missing if e["name"] not in served]


def report() -> Dict[str, Any]:
    """Everything ``torchpatch doctor`` says, with its ``exit`` status."""
    from .patches import NEWEST_TESTED_TORCH

    cfg = Config.from_environ()
    plans = plan(cfg=cfg)
    torch = _versions.torch_version()
    deps = dependencies()
    missing = [DEPENDENCIES[name] for name, version in deps.items() if version is None]
    activation = _activation()
    copies = installed_copies()
    hazards = _hazards(torch) + _copies_hazard(copies)
    if activation["on"] and not activation["hook_ran"]:
        hazards.append(
            "TORCHPATCH is on but torchpatch's start-up hook did not run in this process, so nothing would be "
            "patched: python -S (no site), or an install whose torchpatch.pth is not processed (pip install"
            f" --target, a PYTHONPATH copy); {NO_HOOK_FIX}")
    return {
        "torchpatch": __version__,
        "location": os.path.dirname(os.path.realpath(__file__)),
        "python": _versions.python_version(),
        "executable": sys.executable,
        "torch": torch,
        "wrapt": deps["wrapt"],
        "packaging": deps["packaging"],
        "missing_dependencies": missing,
        "numpy": _dist_version("numpy"),
        "startup_hook": _installed_startup_hooks(),
        "copies": copies,
        "activation": activation,
        "how_to_tell": HOW_TO_TELL,
        "flags": {k: v for k, v in sorted(os.environ.items()) if k.startswith("TORCHPATCH")},
        "strict": cfg.strict,
        "log_level": cfg.log_level,
        "would_apply": [p.patch.id for p in plans if p.active],
        "switched_off": {p.patch.id: p.decision.reason for p in plans if p.applies and not p.decision.enabled},
        "newest_tested_torch": NEWEST_TESTED_TORCH,
        "warnings": cfg.warnings + _untested(torch, NEWEST_TESTED_TORCH, plans),
        "hazards": hazards,
        "not_backportable": _not_backportable(torch, [p.patch for p in plans], cfg),
        "silent_bugs": known_bugs_for(torch, plans, activation["on"]),
        "exit": MISSING if missing else HAZARD if hazards else OK,
    }


def format_text(report: Dict[str, Any]) -> str:
    """The report for people, one line per fact; problems in capitals."""
    torch = report["torch"]
    hook = ", ".join(report["startup_hook"]) or f"NOT FOUND: TORCHPATCH=1 does nothing from this interpreter; {NO_HOOK_FIX}"
    deps = [f"{name:<12} {version}" if version else
            f"{name:<12} MISSING: torchpatch cannot patch without it; pip install '{DEPENDENCIES[name]}'"
            for name, version in ((n, report[n]) for n in DEPENDENCIES)]
    lines = [
        f"torchpatch   {report['torchpatch']} ({report['location']})",
        f"python       {report['python']} ({report['executable']})",
        f"torch        {torch or 'not installed'}",
        *deps,
        f"numpy        {report['numpy'] or 'not installed'}",
        f"start-up     {hook}",
        "activation   " + report["activation"]["text"].replace("activation is ", "", 1),
        "flags        " + (" ".join(f"{shown(k)}={shown(v)}" for k, v in report["flags"].items()) or "none"),
        "would apply  " + (", ".join(report["would_apply"]) or "nothing"),
    ]
    lines += [f"switched off {k}: {v}" for k, v in report["switched_off"].items()]
    lines += [f"warning      {w}" for w in report["warnings"]]
    lines += [f"HAZARD       {h}" for h in report["hazards"]] or ["hazards      none found"]
    lines += [f"not here     {e['what']}: {e['name']} needs torch {e['torch']} (cannot be backported)"
              for e in report["not_backportable"]]
    lines += [(f"silent bug   fixed: {b['id']}" if b["fixed"] else f"SILENT BUG   NOT FIXED: {b['id']}")
              + f" (torch {b['torch']}): {b['what']}; {b['why']}; {b['upstream']}" for b in report["silent_bugs"]]
    if torch and not report["silent_bugs"]:
        lines.append(f"silent bugs  none known for torch {torch}")
    lines.append(f"did it act?  {report['how_to_tell']}")
    lines.append(f"exit         {report['exit']}")
    return "\n".join(lines)
