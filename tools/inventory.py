"""Inventory the installed torch's distributed-facing modules and names, as data for torchpatch.

    <venv>/bin/python tools/inventory.py            # writes patches/_data/inventory/torch-<version>.json.gz

Imports every module under the roots below (each in a try: a module that fails to import natively is
recorded as failing, with its error) and records, per module, every attribute name (dunder names
aside) as ``"module:qualname"`` for classes and functions (where they are defined), ``"<module>"`` for
submodules, and ``""`` for other values; each module's ``__all__`` where it defines one (``exports``); the call signatures (annotations dropped) of the public functions and
classes each module defines; and the members of every class that ``torch.distributed`` exposes (``classes``:
``"module:qualname" -> {"members": [...], "init": "(...)", "extends": [...]}``; ``extends`` names the big
common bases, ``nn.Module`` and ``Tensor``, whose members are recorded once under ``bases`` instead of per class). ``walked`` and ``walk_skips`` say which packages were walked whole (a module
under them that is not listed does not exist), so that a reader can tell "absent" from "not looked at". torchpatch's relocation table is derived from and checked
against these files (tools/relocations.py), and ``torchpatch check --torch X`` reads them.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import inspect
import json
import pkgutil
import re
import sys
import types
import warnings
from pathlib import Path
from typing import Dict, List, Optional

WALK = ["torch.distributed", "torch.nn", "torch.optim", "torch.utils.checkpoint", "torch.nn.attention"]
SINGLE = ["torch", "torch._utils", "torch.backends.cuda", "torch.cuda", "torch.amp", "torch.utils", "torch.library",
          "torch.utils._python_dispatch", "torch.autograd", "torch.autograd.function",
          # what training code written for older torch calls beside torch.distributed
          "torch.cuda.amp", "torch.cpu.amp", "torch.amp.grad_scaler", "torch.serialization", "torch.utils.data",
          "torch.profiler", "torch._dynamo", "torch.export", "torch.func", "torch.overrides", "torch.types"]
SKIP_PARTS = ("tests", "testing", "benchmarks", "examples")
# Classes exposed by these packages have their members recorded.
MEMBER_ROOTS = ("torch.distributed",)
# Bases whose (many) members are recorded once and referred to by classes that derive from them.
BIG_BASES = ("torch.nn:Module", "torch:Tensor")
OUT = Path(__file__).resolve().parent.parent / "src" / "torchpatch" / "patches" / "_data" / "inventory"


def _describe(value: object) -> str:
    if isinstance(value, types.ModuleType):
        return "<module>"
    if inspect.isclass(value) or inspect.isfunction(value) or inspect.isbuiltin(value):
        module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
        if isinstance(module, str) and isinstance(qualname, str):
            return f"{module}:{qualname}"
    return ""


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")


def _call_shape(value: object) -> str:
    """The signature without annotations: parameter names, kinds and defaults (what callers see), with
    no memory addresses (``<function f at 0x...>`` defaults), so that the same torch gives the same file."""
    sig = inspect.signature(value)  # type: ignore[arg-type]
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return _ADDRESS.sub(">", str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty)))


def _members(cls: type) -> List[str]:
    """Every attribute name of ``cls`` (inherited ones too), dunders aside."""
    return sorted(n for n in dir(cls) if not (n.startswith("__") and n.endswith("__")))


def _init_params(cls: type) -> Optional[str]:
    init = getattr(cls, "__init__", None)
    if init is None or init is object.__init__:
        return None
    try:
        return _call_shape(init)
    except (TypeError, ValueError):
        return None


def class_members(modules: Dict[str, Dict[str, object]]) -> Dict[str, object]:
    """The members of the classes the modules under MEMBER_ROOTS expose, and of the big bases once."""
    bases = {}
    for spec in BIG_BASES:
        module, _, qualname = spec.partition(":")
        bases[spec] = getattr(importlib.import_module(module), qualname)
    base_members = {spec: _members(base) for spec, base in bases.items()}
    classes: Dict[str, object] = {}
    for name in sorted(modules):
        if not name.startswith(MEMBER_ROOTS):
            continue
        module = sys.modules.get(name)
        for attr in sorted(modules[name]):
            value = getattr(module, attr, None)
            key = _describe(value)
            if not inspect.isclass(value) or not key or key in classes or not key.startswith("torch"):
                continue
            extends = [spec for spec, base in bases.items() if issubclass(value, base)]
            inherited = set().union(*(base_members[spec] for spec in extends))
            classes[key] = {"members": [m for m in _members(value) if m not in inherited],
                            "init": _init_params(value), "extends": extends}
    return {"classes": classes, "bases": base_members}


def module_names() -> List[str]:
    names = set(SINGLE)
    for root in WALK:
        try:
            package = importlib.import_module(root)
        except Exception:
            continue
        names.add(root)
        for info in pkgutil.walk_packages(getattr(package, "__path__", []), root + ".", onerror=lambda _n: None):
            if not any(part in SKIP_PARTS for part in info.name.split(".")):
                names.add(info.name)
    return sorted(names)


def inventory() -> Dict[str, object]:
    import torch

    modules: Dict[str, object] = {}
    signatures: Dict[str, Dict[str, str]] = {}
    failing: Dict[str, str] = {}
    exports: Dict[str, List[str]] = {}
    for name in module_names():
        try:
            module = importlib.import_module(name)
        except BaseException as exc:  # some modules exit or raise non-Exceptions on import
            failing[name] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        entries, sigs = {}, {}
        for attr in dir(module):
            if attr.startswith("__") and attr.endswith("__"):
                continue
            try:
                value = getattr(module, attr)
                entries[attr] = _describe(value)
            except Exception:
                entries[attr] = ""
                continue
            if entries[attr].startswith(name + ":") and not attr.startswith("_"):
                try:
                    sigs[attr] = _call_shape(value)
                except (TypeError, ValueError):
                    pass
        modules[name] = entries
        listed = getattr(module, "__all__", None)
        if isinstance(listed, (list, tuple)) and all(isinstance(n, str) for n in listed):
            exports[name] = sorted(set(listed))
        if sigs:
            signatures[name] = sigs
    # Compatibility packages register some submodules in sys.modules without a file of their own
    # (torch 2.5+'s torch.distributed._tensor shim): they import, so they exist.
    roots = tuple(r + "." for r in WALK)
    for name, module in sorted(sys.modules.items()):
        if name.startswith(roots) and name not in modules and isinstance(module, types.ModuleType):
            modules[name] = {a: _describe(getattr(module, a, None)) for a in dir(module) if not a.startswith("__")}
    return {"torch": torch.__version__.split("+")[0], "python": "%d.%d" % sys.version_info[:2],
            "modules": modules, "signatures": signatures, "failing": failing, "exports": exports,
            "walked": WALK, "walk_skips": list(SKIP_PARTS), **class_members(modules)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="output file (default: patches/_data/inventory/torch-<version>.json.gz)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    data = inventory()
    out = args.out or OUT / f"torch-{data['torch']}.json.gz"
    payload = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as fh:  # reproducible bytes
        fh.write(payload)
    print(f"{out}: {len(data['modules'])} modules, {len(data['failing'])} failing to import, "
          f"members of {len(data['classes'])} classes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
