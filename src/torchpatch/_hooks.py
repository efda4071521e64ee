"""Import machinery, knowing nothing about torch.

- :class:`ImportWatcher`, first on ``sys.meta_path``: for the few module names it watches, wraps
  the loader that the other finders return so that callbacks run just before and just after the
  module's code executes. Any other name costs one ``dict`` lookup.
- :class:`ShimFinder`, last on ``sys.meta_path``: serves a shim module for a name that no other
  finder found, so it can never shadow a module that exists.

Every module the shim finder serves is reported, with the action that takes it back, to the
``record`` it was registered with (see ``_record``): its ``sys.modules`` entry, the attribute
importlib sets on its parent package, an alias package's registration and the children served under
it. A real module served under another name keeps its own ``__spec__`` and ``__loader__``. Each
module it serves is also noted, once, in :attr:`ShimFinder.served` (what the process used).

The finders and loaders implement the import protocols without deriving from ``importlib.abc``,
whose import alone costs milliseconds at every start-up.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from importlib.machinery import ModuleSpec
from types import CodeType, ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ._record import Record

ModuleCallback = Callable[[ModuleType], None]


class _WatchedLoader:
    """Delegates to the real loader, running the watcher's callbacks around ``exec_module``."""

    def __init__(self, loader: Any, watcher: "ImportWatcher") -> None:
        self._loader = loader
        self._watcher = watcher

    def create_module(self, spec: ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # importlib stamped this wrapper as the module's loader: reload() and introspection must
        # see the real one. A module that already had a loader of its own keeps it untouched.
        if vars(module).get("__loader__") is self:
            module.__loader__ = self._loader
        if module.__spec__ is not None and module.__spec__.loader is self:
            module.__spec__.loader = self._loader
        name = module.__name__
        finish = self._watcher._before(name, module)
        try:
            self._loader.exec_module(module)
        finally:
            finish()
        self._watcher._after(name, module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, get_filename, ...
        return getattr(self._loader, name)


class ImportWatcher:
    """Calls back around the execution of watched modules' code."""

    def __init__(self) -> None:
        # name -> callbacks; each "before" callback returns a function to call after the body ran.
        self._before_cbs: Dict[str, List[Callable[[ModuleType], Callable[[], None]]]] = {}
        self._after_cbs: Dict[str, List[ModuleCallback]] = {}
        self._watched: set = set()
        self._local = threading.local()
        # Served alias packages (alias -> (target, record)), shared with the ShimFinder: their
        # submodules must come from the target package, never load a second time through the
        # alias's __path__.
        self.alias_packages: Dict[str, Tuple[str, Record]] = {}
        self.alias_child: Optional[Callable[[str], Optional[ModuleSpec]]] = None

    def before(self, name: str, callback: Callable[[ModuleType], Callable[[], None]]) -> None:
        self._before_cbs.setdefault(name, []).append(callback)
        self._watched.add(name)

    def after(self, name: str, callback: ModuleCallback) -> None:
        """Run ``callback(module)`` once ``name`` has been imported; at once if it already is."""
        self._after_cbs.setdefault(name, []).append(callback)
        self._watched.add(name)
        module = sys.modules.get(name)
        if module is not None:
            callback(module)

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None
    ) -> Optional[ModuleSpec]:
        if fullname not in self._watched:
            if self.alias_packages and self.alias_child is not None and fullname.rpartition(".")[0] in self.alias_packages:
                return self.alias_child(fullname)
            return None
        busy = self._local.__dict__.setdefault("busy", set())
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            spec = self._find_elsewhere(fullname, path, target)
        finally:
            busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _WatchedLoader(spec.loader, self)
        return spec

    def _find_elsewhere(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType]
    ) -> Optional[ModuleSpec]:
        for finder in list(sys.meta_path):
            if finder is self:
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def _before(self, name: str, module: ModuleType) -> Callable[[], None]:
        finishers = [cb(module) for cb in self._before_cbs.get(name, ())]

        def finish() -> None:
            for fn in reversed(finishers):
                fn()

        return finish

    def _after(self, name: str, module: ModuleType) -> None:
        for cb in list(self._after_cbs.get(name, ())):
            cb(module)


_MISSING = object()
# What importlib writes on a module it loads; a real module served under another name keeps its own.
_IMPORT_ATTRS = ("__name__", "__loader__", "__package__", "__spec__", "__path__", "__file__", "__cached__")


def _forget(name: str, module: ModuleType) -> Callable[[], None]:
    """The undo of serving ``module`` as ``name``: its ``sys.modules`` entry, and the parent's
    attribute that importlib sets, if the parent did not already hold this module before."""
    parent_name, _, leaf = name.rpartition(".")
    parent = sys.modules.get(parent_name)
    previous = vars(parent).get(leaf, _MISSING) if parent is not None else _MISSING

    def undo() -> None:
        if sys.modules.get(name) is module:
            del sys.modules[name]
        if parent is not None and previous is not module and vars(parent).get(leaf) is module:
            if previous is _MISSING:
                delattr(parent, leaf)
            else:
                setattr(parent, leaf, previous)

    return undo


class _ShimLoader:
    """Builds a fresh shim module, or hands out an existing module under another name (alias)."""

    def __init__(self, record: Record, served: Dict[str, Tuple[str, str]], build: Optional[ModuleCallback] = None,
                 resolve: Optional[Callable[[], ModuleType]] = None,
                 packages: Optional[Dict[str, Tuple[str, Record]]] = None) -> None:
        self._record = record
        self._served = served
        self._build = build
        self._resolve = resolve
        self._packages = packages
        self._own: Dict[str, Any] = {}

    def create_module(self, spec: ModuleSpec) -> Optional[ModuleType]:
        if self._resolve is None:
            return None
        module = self._resolve()
        self._own = {k: vars(module).get(k, _MISSING) for k in _IMPORT_ATTRS}
        self._record.add(_forget(spec.name, module))
        if self._packages is not None and hasattr(module, "__path__"):
            self._packages[spec.name] = (module.__name__, self._record)
            packages = self._packages
            self._record.add(lambda: packages.pop(spec.name, None))
        return module

    def exec_module(self, module: ModuleType) -> None:
        if self._resolve is not None:
            # importlib stamped the alias's spec on the real module: give it its own back.
            alias = module.__spec__.name if module.__spec__ is not None else ""
            for key, value in self._own.items():
                if vars(module).get(key, _MISSING) is not value:
                    if value is _MISSING:
                        delattr(module, key)
                    else:
                        setattr(module, key, value)
            _keep_parent_attribute(alias, module)
            self._served.setdefault(alias, (self._record.owner, module.__name__))
        elif self._build is not None:
            self._record.add(_forget(module.__name__, module))
            self._build(module)
            self._served.setdefault(module.__name__, (self._record.owner, ""))

    def get_code(self, fullname: str) -> Optional[CodeType]:
        """``python -m`` on a served module: runs what its builder set as ``__torchpatch_main__`` (the
        module's ``if __name__ == "__main__":`` block, where torch's has one), else nothing, as a module
        without such a block does."""
        if self._build is None:
            return None
        source = ("import importlib, sys\n"
                  f"if sys.argv and sys.argv[0] is None:  # runpy's origin of a module with no file\n"
                  f"    sys.argv[0] = {fullname!r}\n"
                  f"_run = getattr(importlib.import_module({fullname!r}), '__torchpatch_main__', None)\n"
                  "if _run is not None:\n    _run()\n")
        return compile(source, f"<served module {fullname}>", "exec")


def _keep_parent_attribute(alias: str, module: ModuleType) -> None:
    """Protect the parent of an alias child from importlib's ``setattr(parent, leaf, module)``.

    Under an alias package the parent *is* the target package, which may hold something else
    under ``leaf``: a function re-exported over its own submodule (``experimental.local_map``).
    A native import of the submodule never clobbers it (the target submodule is already in
    ``sys.modules``), so neither may its import under the alias name. The parent's class is
    swapped, just until that one ``setattr``, for a subclass that swallows it.
    """
    parent_name, _, leaf = alias.rpartition(".")
    parent = sys.modules.get(parent_name)
    if parent is None or vars(parent).get(leaf, module) is module:
        return
    cls = type(parent)

    def __setattr__(self: ModuleType, name: str, value: Any) -> None:
        if name == leaf and value is module:
            object.__setattr__(self, "__class__", cls)
            return
        cls.__setattr__(self, name, value)

    parent.__class__ = type(cls.__name__, (cls,), {"__setattr__": __setattr__, "__module__": cls.__module__})


class ShimFinder:
    """Serves registered shim modules and module aliases; placed last on ``sys.meta_path``, so only
    names that no other finder found reach it.

    An alias that is a package records itself in ``alias_packages`` (shared with the
    :class:`ImportWatcher`, which stands first): a submodule imported under the alias is then the
    target's own submodule, the same object, instead of a second copy loaded through the package's
    ``__path__``.
    """

    def __init__(self, alias_packages: Optional[Dict[str, Tuple[str, Record]]] = None) -> None:
        self.shims: Dict[str, Tuple[ModuleCallback, Record]] = {}
        self.aliases: Dict[str, Tuple[Callable[[], ModuleType], Record]] = {}
        self.alias_packages = alias_packages if alias_packages is not None else {}
        # Module name -> (owner of its record, the real module's name for an alias else ""): every
        # module served so far, noted once when it is loaded (later imports find it in sys.modules).
        self.served: Dict[str, Tuple[str, str]] = {}

    def add_shim(self, name: str, build: ModuleCallback, record: Record) -> None:
        """Serve module ``name``, where no other finder finds it, as a new module ``build`` fills."""
        self.shims[name] = (build, record)

    def add_alias(self, name: str, resolve: Callable[[], ModuleType], record: Record) -> None:
        """Serve module ``name``, where no other finder finds it, as the module ``resolve()`` returns."""
        self.aliases.setdefault(name, (resolve, record))

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None
    ) -> Optional[ModuleSpec]:
        shim = self.shims.get(fullname)
        alias = None if shim is not None else self.aliases.get(fullname)  # a built shim wins
        if shim is not None:
            loader = _ShimLoader(shim[1], self.served, build=shim[0])
        elif alias is not None:
            loader = _ShimLoader(alias[1], self.served, resolve=alias[0], packages=self.alias_packages)
        else:
            return None
        prefix = fullname + "."
        is_package = shim is not None and any(name.startswith(prefix) for name in self.shims)
        return importlib.util.spec_from_loader(fullname, loader, is_package=is_package)

    def alias_child(self, fullname: str) -> Optional[ModuleSpec]:
        """Spec for ``fullname`` whose parent is a served alias package: its own alias if it has
        one, else the target package's submodule of the same name (recorded with the package)."""
        if fullname not in self.aliases:
            parent, _, leaf = fullname.rpartition(".")
            package, record = self.alias_packages[parent]
            target = f"{package}.{leaf}"
            if importlib.util.find_spec(target) is None:
                return None
            self.aliases[fullname] = (lambda: importlib.import_module(target), record)
            aliases = self.aliases
            record.add(lambda: aliases.pop(fullname, None))
        return self.find_spec(fullname)
