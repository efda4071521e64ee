"""One installation: each enabled patch's hooks armed on the import machinery, and run fail-safe.

A patch whose hook raises (or whose served module or symbol cannot be made) is marked failed and
everything it changed is taken back, with every armed patch that requires it; ``TORCHPATCH_STRICT=1``
makes that an error. What the hooks changed is kept per patch (``_record``); hook runs are redone
after an ``importlib.reload`` of a module they changed (``_reloads``); :meth:`Installation.outcome`
is what the summary line, ``torchpatch.status()`` and the report read.
"""

from __future__ import annotations

import importlib
import sys
import time
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional

from . import _versions
from ._hooks import ImportWatcher, ShimFinder
from ._outcome import APPLIED, FAILED, NOT_NEEDED, WAITING, Outcome
from ._patch import Patch, Patcher
from ._plan import PatchPlan
from ._record import Journal
from ._reloads import HookRun, ReloadTracker
from ._summary import log
from ._symbols import SymbolServer


class PatchError(RuntimeError):
    """A patch failed while applying and ``TORCHPATCH_STRICT=1`` asked for an error."""


class Installation:
    """Everything one ``install()`` armed, and a :class:`Record` per patch of what it changed."""

    def __init__(self, plans: List[PatchPlan], strict: bool) -> None:
        self._plans = plans
        self._strict = strict  # TORCHPATCH_STRICT: a failed patch raises PatchError
        self._watcher = ImportWatcher()
        self._shims = ShimFinder(self._watcher.alias_packages)
        self._watcher.alias_child = self._shims.alias_child
        self._symbols = SymbolServer()
        self._journal = Journal()
        self._reloads = ReloadTracker(self._watcher, self._live)
        self._status: Dict[str, str] = {}
        self._errors: Dict[str, str] = {}  # patch id -> why it failed
        self._symbols_used: Dict[str, str] = {}  # "module.name" -> patch id: served symbols made so far
        self.on_settled: Optional[Callable[[], None]] = None  # called when a patch has applied or failed
        self._started = time.time()
        self._needed_by: Dict[str, List[str]] = {}  # patch id -> armed patches that require it

    def outcome(self) -> Outcome:
        """What this installation has done so far (a snapshot)."""
        switched_off = {p.patch.id: p.decision.reason for p in self._plans if p.applies and not p.decision.enabled}
        return Outcome(self._started, dict(self._status), dict(self._errors), switched_off,
                       dict(self._shims.served), dict(self._symbols_used))

    # -- whole installation ----------------------------------------------------------------
    def start(self) -> None:
        sys.meta_path.insert(0, self._watcher)
        sys.meta_path.append(self._shims)
        active = [p.patch for p in self._plans if p.active]
        armed = {patch.id for patch in active}
        for patch in active:
            for need in armed.intersection(patch.requires):
                self._needed_by.setdefault(need, []).append(patch.id)
        for patch in active:
            self._arm(patch)

    def stop(self) -> None:
        for finder in (self._watcher, self._shims):
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
        for error in self._journal.undo_all():
            log.warning("uninstall: %s", error)
        self._reloads.clear()

    # -- fail-safe application -------------------------------------------------------------
    def _fail(self, patch: Patch, where: str, exc: BaseException) -> None:
        """Log once, mark the patch (and what requires it) failed and take back all it changed;
        raise if strict."""
        first = self._status.get(patch.id) != FAILED
        self._take_back(patch.id)
        if first:
            self._status[patch.id] = FAILED
            self._errors[patch.id] = f"while applying to {where}: {type(exc).__name__}: {exc}"
            message = f"patch {patch.id} failed while applying to {where} ({type(exc).__name__}: {exc})"
            if self._strict:
                log.error("%s", message)
            else:
                log.warning("%s and was taken back; set TORCHPATCH_STRICT=1 to make this an error", message)
            self._fail_dependents(patch.id)
            self._settled()
        if self._strict:
            raise PatchError(f"torchpatch patch {patch.id} failed while applying to {where}: {exc}") from exc

    def _fail_dependents(self, failed: str) -> None:
        for dependent in self._needed_by.get(failed, ()):
            if self._status.get(dependent) != FAILED:
                self._take_back(dependent)
                self._status[dependent] = FAILED
                self._errors[dependent] = f"requires {failed}, which failed"
                log.warning("patch %s was taken back: it requires %s, which failed", dependent, failed)
                self._fail_dependents(dependent)

    def _take_back(self, patch_id: str) -> None:
        errors = self._journal.record(patch_id).undo()
        self._reloads.forget(patch_id)
        for error in errors:
            log.warning("taking back patch %s: %s", patch_id, error)

    def _mark(self, patch: Patch, status: str) -> None:
        """Record progress: a patch once applied (or failed) stays so."""
        if self._status.get(patch.id) not in (APPLIED, FAILED):
            self._status[patch.id] = status
            if status == APPLIED:
                log.debug("applied %s", patch.id)
                self._settled()

    def _settled(self) -> None:
        if self.on_settled is not None:
            self.on_settled()

    def _live(self, patch: Patch) -> bool:
        return self._status.get(patch.id) != FAILED

    # -- arming: each declaration of a patch becomes a hook on the import machinery ---------
    def _arm(self, patch: Patch) -> None:
        if self._status.setdefault(patch.id, WAITING) == FAILED:  # a requirement already failed
            return
        record = self._journal.record(patch.id)
        for name, build in patch.modules.items():
            self._shims.add_shim(name, self._shim_builder(patch, name, build), record)
        for name, target, torch in patch.aliases:
            if _versions.matches(torch, _versions.torch_version()):
                self._shims.add_alias(name, self._alias_resolver(patch, name, target), record)
        by_module: Dict[str, Dict[str, Callable[[], Any]]] = {}
        for (module, name), factory in patch.symbols.items():
            by_module.setdefault(module, {})[name] = self._symbol_factory(patch, module, name, factory)
        for module, names in by_module.items():
            self._watcher.after(module, self._symbol_hook(patch, module, names))
        for module, hook in patch.import_time_hooks:
            self._watcher.before(module, self._import_time_hook(patch, module, hook))
        for module, hook in patch.import_hooks:
            self._watcher.after(module, self._import_hook(patch, module, hook))

    def _shim_builder(self, patch: Patch, name: str, build: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
        def run(module: ModuleType) -> None:
            if not self._live(patch):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            try:
                module.__torchpatch__ = patch.id  # type: ignore[attr-defined]
                build(module)
            except (Exception, SystemExit) as exc:  # a patch never ends the job
                self._fail(patch, f"module {name}", exc)
                raise ModuleNotFoundError(f"No module named {name!r}", name=name) from exc
            self._mark(patch, APPLIED)

        return run

    def _alias_resolver(self, patch: Patch, name: str, target: str) -> Callable[[], ModuleType]:
        def resolve() -> ModuleType:
            if self._live(patch):
                try:
                    module = importlib.import_module(target)
                except ModuleNotFoundError as exc:
                    if exc.name is None or not (target == exc.name or target.startswith(exc.name + ".")):
                        self._fail(patch, f"module {name} (= {target})", exc)
                    # else: the other name is missing too on this torch, so there is nothing to serve
                except (Exception, SystemExit) as exc:
                    self._fail(patch, f"module {name} (= {target})", exc)
                else:
                    self._mark(patch, APPLIED)
                    return module
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        return resolve

    def _symbol_factory(self, patch: Patch, module: str, name: str, factory: Callable[[], Any]) -> Callable[[], Any]:
        def make() -> Any:
            if self._live(patch):
                try:
                    value = factory()
                except (Exception, SystemExit) as exc:
                    self._fail(patch, f"{module}.{name}", exc)
                else:
                    self._symbols_used.setdefault(f"{module}.{name}", patch.id)
                    return value
            raise AttributeError(f"module {module!r} has no attribute {name!r}")

        return make

    def _symbol_hook(self, patch: Patch, where: str, names: Dict[str, Callable[[], Any]]) -> Callable[[ModuleType], None]:
        def apply(module: ModuleType) -> None:
            if not self._live(patch):
                return
            try:
                served, undo = self._symbols.serve(module, names)
            except (Exception, SystemExit) as exc:
                self._fail(patch, where, exc)
                return
            self._journal.record(patch.id).add(undo)
            self._reloads.ran(HookRun(patch, where, module, apply, undo, {where}))
            self._mark(patch, APPLIED if served else NOT_NEEDED)

        return apply

    def _run_hook(self, patch: Patch, where: str, hook: Callable[..., Optional[bool]], module: ModuleType) -> Optional[Patcher]:
        """Run one hook fail-safe, its changes in the patch's record; its Patcher, or None if the
        patch is (or just became) failed."""
        if not self._live(patch):
            return None
        patcher = Patcher()
        self._journal.record(patch.id).add(patcher.undo)
        try:
            result = hook(patcher, module)
        except (Exception, SystemExit) as exc:
            self._fail(patch, where, exc)
            return None
        patcher.settle(self._journal.record(patch.id).add)  # later changes: recorded as they are made
        self._mark(patch, NOT_NEEDED if result is False else APPLIED)
        return patcher

    def _import_hook(self, patch: Patch, where: str, hook: Callable[..., Optional[bool]]) -> Callable[[ModuleType], None]:
        def apply(module: ModuleType) -> None:
            patcher = self._run_hook(patch, where, hook, module)
            if patcher is not None:
                self._reloads.ran(HookRun(patch, where, module, apply, patcher.undo, {where} | patcher.modules_changed()))

        return apply

    def _import_time_hook(self, patch: Patch, where: str, hook: Callable[..., Optional[bool]]) -> Callable[[ModuleType], Callable[[], None]]:
        def run(module: ModuleType) -> Callable[[], None]:
            patcher = self._run_hook(patch, where, hook, module)
            return patcher.undo if patcher is not None else (lambda: None)

        return run
