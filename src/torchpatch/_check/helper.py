"""The helper interpreter of ``torchpatch check``: it imports the installed torch once and answers
what exists there, one JSON line per question read from stdin.

    python -m torchpatch._check.helper            # torch as it is (torchpatch off)
    python -m torchpatch._check.helper --patched  # with torchpatch installed first: what shims hold

A submodule of torch is not imported to see that it exists: its file answers (:mod:`.source`),
as do the plain top-level bindings of a module not imported yet; so a module that exists but
fails to import here (it needs a package this environment lacks) counts as present, as it does in
the inventories.

Questions: ``["child", module, name]`` (what ``module.name`` is) and ``["op", namespace, name]``
(whether ``torch.ops.<namespace>.<name>`` exists). Answers: ``[kind, real module name, note]``,
kind one of ``module``, ``attr``, ``missing``, ``unknown``. Whatever torch prints goes to stderr.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import types
import warnings
from typing import Any, Dict, List, Optional, Set, Union

from torchpatch._check.source import static_child

NOTE_LIMIT = 400
ROOT = "torch"


class Torch:
    """The installed torch, imported once; its modules imported as asked."""

    def __init__(self, patched: bool) -> None:
        self.modules: Dict[str, Union[types.ModuleType, str]] = {}
        self.namespaces: Optional[Set[str]] = None
        self.broken = ""
        self.torch: Any = None
        try:
            if patched:
                import torchpatch

                torchpatch.install()
            import torch

            self.torch = torch
        except BaseException as exc:  # torch may raise anything, SystemExit included
            self.broken = f"torch does not import here: {type(exc).__name__}: {exc}"
        self.mode = "torchpatch on" if patched else "torchpatch off"

    def module(self, name: str) -> Union[types.ModuleType, str]:
        """The module, or why it does not import."""
        if name not in self.modules:
            try:
                self.modules[name] = importlib.import_module(name)
            except BaseException as exc:
                self.modules[name] = f"{name} fails to import here ({self.mode}): {type(exc).__name__}: {exc}"
        return self.modules[name]

    def child(self, name: str, part: str) -> List[str]:
        imported = sys.modules.get(name)
        if name.startswith(f"{ROOT}.") and (imported is None or not hasattr(imported, part)):
            # importing a module of torch may cost seconds: its source may say enough
            found = static_child(os.path.dirname(self.torch.__file__), name, part)
            if found is not None and found["kind"] == "module":
                return ["module", found["name"], ""]
            if found is not None and imported is None:  # an imported module's missing attribute stays missing
                return ["attr", "", ""]
        mod = self.module(name)
        if isinstance(mod, str):
            return ["unknown", "", mod[:NOTE_LIMIT]]
        full = f"{name}.{part}"
        try:
            value = getattr(mod, part)
        except Exception:
            pass
        else:
            if isinstance(value, types.ModuleType):
                return ["module", value.__name__ if value.__name__.startswith("torch") else full, ""]
            return ["attr", "", ""]
        if not hasattr(mod, "__path__"):
            return ["missing", "", ""]
        try:
            spec = importlib.util.find_spec(full)
        except BaseException:
            spec = None
        if spec is None:
            return ["missing", "", ""]
        sub = self.module(full)
        return ["unknown", "", sub[:NOTE_LIMIT]] if isinstance(sub, str) else ["module", full, ""]

    def op(self, namespace: str, name: str) -> List[str]:
        self.module("torch.distributed")  # registers the Python-defined collective ops where torch has them
        try:
            getattr(getattr(self.torch.ops, namespace), name)
            return ["attr", "", ""]
        except Exception:
            pass
        if namespace in self._namespaces():
            return ["missing", "", ""]
        return ["unknown", "", f"no operator namespace {namespace!r} in this torch: registered at run time "
                "by an extension or your code, if at all"]

    def _namespaces(self) -> Set[str]:
        if self.namespaces is None:
            try:
                names = self.torch._C._dispatch_get_all_op_names()
            except AttributeError:
                names = [s.name for s in self.torch._C._jit_get_all_schemas()]
            self.namespaces = {n.split("::")[0] for n in names}
        return self.namespaces

    def answer(self, query: List[str]) -> List[str]:
        if self.broken:
            return ["unknown", "", self.broken[:NOTE_LIMIT]]
        return self.op(query[1], query[2]) if query[0] == "op" else self.child(query[1], query[2])


def main(argv: List[str]) -> int:
    warnings.simplefilter("ignore")
    out = os.fdopen(os.dup(1), "w")  # the answers; whatever torch prints (C code too) goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    torch = Torch(patched="--patched" in argv)
    for line in sys.stdin:
        out.write(json.dumps(torch.answer(json.loads(line))) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
