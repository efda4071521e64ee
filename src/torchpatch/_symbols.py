"""Serving missing attributes of modules, lazily, never replacing one that exists.

:class:`SymbolServer` installs a module-level ``__getattr__`` (PEP 562), which Python calls only for
names the module does not have. It first defers to the module's own ``__getattr__`` (if it had one)
and only then makes the served object, caching it in the module. Each :meth:`SymbolServer.serve`
returns the action that takes back exactly what it served, cached values included.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Dict, List, Tuple

Factory = Callable[[], Any]
_MISSING = object()


class _Served:
    """One module's served names: the ``__getattr__`` installed on it and what it replaced."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.original = vars(module).get("__getattr__")
        self.table: Dict[str, Factory] = {}
        self.cached: Dict[str, Any] = {}
        modname = module.__name__

        def __getattr__(name: str) -> Any:
            factory = self.table.get(name)
            if self.original is not None:
                try:
                    return self.original(name)
                except AttributeError:
                    if factory is None:
                        raise
            if factory is None:
                raise AttributeError(f"module {modname!r} has no attribute {name!r}")
            value = factory()
            setattr(module, name, value)
            if self.table.get(name) is factory:  # not withdrawn while the factory ran
                self.cached[name] = value
            return value

        self.hook = __getattr__
        module.__getattr__ = __getattr__  # type: ignore[method-assign]

    @property
    def current(self) -> bool:
        """Whether the module still uses this ``__getattr__`` (a reload may have replaced it)."""
        return vars(self.module).get("__getattr__") is self.hook


class SymbolServer:
    def __init__(self) -> None:
        self._served: Dict[int, _Served] = {}  # id(module) -> its served names

    def serve(self, module: ModuleType, names: Dict[str, Factory]) -> Tuple[List[str], Callable[[], None]]:
        """Serve those of ``names`` that ``module`` lacks (and no earlier call serves); returns them
        and the action that withdraws them again."""
        served = self._served.get(id(module))
        if served is not None and not served.current:
            self._forget(served)
            served = None
        missing = [n for n in names if n not in vars(module) and (served is None or n not in served.table)]
        if not missing:
            return [], lambda: None
        if served is None:
            served = self._served[id(module)] = _Served(module)
        served.table.update({n: names[n] for n in missing})
        return missing, lambda: self._withdraw(served, missing)

    def _withdraw(self, served: _Served, names: List[str]) -> None:
        module = served.module
        for name in names:
            served.table.pop(name, None)
            value = served.cached.pop(name, _MISSING)
            if value is not _MISSING and vars(module).get(name, _MISSING) is value:
                delattr(module, name)
        if not served.table:
            if served.current:
                if served.original is None:
                    del module.__getattr__
                else:
                    module.__getattr__ = served.original  # type: ignore[method-assign]
            self._forget(served)

    def _forget(self, served: _Served) -> None:
        if self._served.get(id(served.module)) is served:
            del self._served[id(served.module)]
