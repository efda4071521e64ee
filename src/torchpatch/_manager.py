"""Installing and uninstalling: arming each enabled patch's hooks, fail-safe, and reporting."""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, List, Mapping, Optional, Set

import _torchpatch_startup

from . import _versions
from ._config import Config
from ._hooks import ImportWatcher, ShimFinder
from ._patch import Patch, Patcher
from ._plan import PatchPlan, plan
from ._record import Journal
from ._summary import JobSummary, configure_logging, log, log_summary
from ._symbols import SymbolServer
from ._version import __version__

APPLIED, NOT_NEEDED, FAILED, WAITING = "applied", "not needed", "failed", "waiting for its module"


class PatchError(RuntimeError):
    """A patch failed while applying and ``TORCHPATCH_STRICT=1`` asked for an error."""


@dataclass(eq=False)
class _HookRun:
    """One application of a patch to a module (a hook's run, or symbols served), which a
    re-execution (``importlib.reload``) of any module it changed must undo and do again."""

    patch: Patch
    module_name: str  # the module the hook is registered on
    module: ModuleType  # the object the hook received
    apply: Callable[[ModuleType], None]
    undo: Callable[[], None]
    touched: Set[str]  # names of the modules whose objects it changed


class _Installation:
    """Everything one ``install()`` armed, and a :class:`Record` per patch of what it changed."""

    def __init__(self, cfg: Config, plans: List[PatchPlan]) -> None:
        self.cfg = cfg
        self.plans = plans
        self.watcher = ImportWatcher()
        self.shims = ShimFinder(self.watcher.alias_packages)
        self.watcher.alias_child = self.shims.alias_child
        self.symbols = SymbolServer()
        self.journal = Journal()
        self.status: Dict[str, str] = {}
        self.errors: Dict[str, str] = {}  # patch id -> why it failed
        self.symbols_used: Dict[str, str] = {}  # "module.name" -> patch id: served symbols made so far
        self.on_settled: Optional[Callable[[], None]] = None  # called when a patch has applied or failed
        self.started = time.time()
        self.needed_by: Dict[str, List[str]] = {}  # patch id -> armed patches that require it
        self.runs: List[_HookRun] = []
        self.reloading: Dict[str, List[_HookRun]] = {}  # module name -> runs to do again after its body
        self.watched_for_reload: Set[str] = set()

    # -- fail-safe application -------------------------------------------------------------
    def _fail(self, patch: Patch, where: str, exc: BaseException) -> None:
        """Log once, mark the patch (and what requires it) failed and take back all it changed;
        raise if strict."""
        first = self.status.get(patch.id) != FAILED
        self._take_back(patch.id)
        if first:
            self.status[patch.id] = FAILED
            self.errors[patch.id] = f"while applying to {where}: {type(exc).__name__}: {exc}"
            message = f"patch {patch.id} failed while applying to {where} ({type(exc).__name__}: {exc})"
            if self.cfg.strict:
                log.error("%s", message)
            else:
                log.warning("%s and was taken back; set TORCHPATCH_STRICT=1 to make this an error", message)
            self._fail_dependents(patch.id)
            self._settled()
        if self.cfg.strict:
            raise PatchError(f"torchpatch patch {patch.id} failed while applying to {where}: {exc}") from exc

    def _fail_dependents(self, failed: str) -> None:
        for dependent in self.needed_by.get(failed, ()):
            if self.status.get(dependent) != FAILED:
                self._take_back(dependent)
                self.status[dependent] = FAILED
                self.errors[dependent] = f"requires {failed}, which failed"
                log.warning("patch %s was taken back: it requires %s, which failed", dependent, failed)
                self._fail_dependents(dependent)

    def _take_back(self, patch_id: str) -> None:
        errors = self.journal.record(patch_id).undo()
        self.runs = [r for r in self.runs if r.patch.id != patch_id]
        for error in errors:
            log.warning("taking back patch %s: %s", patch_id, error)

    def _mark(self, patch: Patch, status: str) -> None:
        """Record progress: a patch once applied (or failed) stays so."""
        if self.status.get(patch.id) not in (APPLIED, FAILED):
            self.status[patch.id] = status
            if status == APPLIED:
                log.debug("applied %s", patch.id)
                self._settled()

    def _settled(self) -> None:
        if self.on_settled is not None:
            self.on_settled()

    def _live(self, patch: Patch) -> bool:
        return self.status.get(patch.id) != FAILED

    def arm(self, patch: Patch) -> None:
        if self.status.setdefault(patch.id, WAITING) == FAILED:  # a requirement already failed
            return
        record = self.journal.record(patch.id)
        for name, build in patch.modules.items():
            self.shims.add_shim(name, self._shim_builder(patch, name, build), record)
        for name, target, torch in patch.aliases:
            if _versions.matches(torch, _versions.torch_version()):
                self.shims.add_alias(name, self._alias_resolver(patch, name, target), record)
        by_module: Dict[str, Dict[str, Callable[[], Any]]] = {}
        for (module, name), factory in patch.symbols.items():
            by_module.setdefault(module, {})[name] = self._symbol_factory(patch, module, name, factory)
        for module, names in by_module.items():
            self.watcher.after(module, self._symbol_hook(patch, module, names))
        for module, hook in patch.import_time_hooks:
            self.watcher.before(module, self._import_time_hook(patch, module, hook))
        for module, hook in patch.import_hooks:
            self.watcher.after(module, self._import_hook(patch, module, hook))

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
                    self.symbols_used.setdefault(f"{module}.{name}", patch.id)
                    return value
            raise AttributeError(f"module {module!r} has no attribute {name!r}")

        return make

    def _symbol_hook(self, patch: Patch, where: str, names: Dict[str, Callable[[], Any]]) -> Callable[[ModuleType], None]:
        def apply(module: ModuleType) -> None:
            if not self._live(patch):
                return
            try:
                served, undo = self.symbols.serve(module, names)
            except (Exception, SystemExit) as exc:
                self._fail(patch, where, exc)
                return
            self.journal.record(patch.id).add(undo)
            self._ran(_HookRun(patch, where, module, apply, undo, {where}))
            self._mark(patch, APPLIED if served else NOT_NEEDED)

        return apply

    def _run_hook(self, patch: Patch, where: str, hook: Callable[..., Optional[bool]], module: ModuleType) -> Optional[Patcher]:
        """Run one hook fail-safe, its changes in the patch's record; its Patcher, or None if the
        patch is (or just became) failed."""
        if not self._live(patch):
            return None
        patcher = Patcher()
        self.journal.record(patch.id).add(patcher.undo)
        try:
            result = hook(patcher, module)
        except (Exception, SystemExit) as exc:
            self._fail(patch, where, exc)
            return None
        self._mark(patch, NOT_NEEDED if result is False else APPLIED)
        return patcher

    def _import_hook(self, patch: Patch, where: str, hook: Callable[..., Optional[bool]]) -> Callable[[ModuleType], None]:
        def apply(module: ModuleType) -> None:
            patcher = self._run_hook(patch, where, hook, module)
            if patcher is not None:
                self._ran(_HookRun(patch, where, module, apply, patcher.undo, {where} | patcher.modules_changed()))

        return apply

    def _import_time_hook(self, patch: Patch, where: str, hook: Callable[..., Optional[bool]]) -> Callable[[ModuleType], Callable[[], None]]:
        def run(module: ModuleType) -> Callable[[], None]:
            patcher = self._run_hook(patch, where, hook, module)
            return patcher.undo if patcher is not None else (lambda: None)

        return run

    # -- importlib.reload of a module that a patch changed ----------------------------------
    def _ran(self, run: _HookRun) -> None:
        self.runs.append(run)
        for name in run.touched - self.watched_for_reload:
            self.watched_for_reload.add(name)
            self.watcher.before(name, self._before_reexec)
            self.watcher.after(name, self._after_reexec)

    def _before_reexec(self, module: ModuleType) -> Callable[[], None]:
        """A module that a patch changed is executed again: undo those changes first (its body
        then defines everything anew), and do them again once the body has run."""
        name = module.__name__
        again = [r for r in self.runs if name in r.touched and self._live(r.patch)]
        for run in reversed(again):
            run.undo()
        self.runs = [r for r in self.runs if r not in again]
        # Hooks registered on this very module run again by themselves, after its body.
        self.reloading[name] = [r for r in again if r.module_name != name]
        return lambda: None

    def _after_reexec(self, module: ModuleType) -> None:
        for run in self.reloading.pop(module.__name__, ()):
            run.apply(run.module)

    # -- whole installation ----------------------------------------------------------------
    def start(self) -> None:
        sys.meta_path.insert(0, self.watcher)
        sys.meta_path.append(self.shims)
        active = [p.patch for p in self.plans if p.active]
        armed = {patch.id for patch in active}
        for patch in active:
            for need in armed.intersection(patch.requires):
                self.needed_by.setdefault(need, []).append(patch.id)
        for patch in active:
            self.arm(patch)

    def stop(self) -> None:
        for finder in (self.watcher, self.shims):
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
        for error in self.journal.undo_all():
            log.warning("uninstall: %s", error)
        self.runs.clear()

    def summary(self) -> str:
        applied = sorted(i for i, s in self.status.items() if s == APPLIED)
        failed = sorted(i for i, s in self.status.items() if s == FAILED)
        line = (
            f"{__version__} on torch {_versions.torch_version() or '(none)'}, "
            f"Python {_versions.python_version()}: applied {', '.join(applied) or 'none'}"
        )
        if failed:
            line += f"; failed and taken back {', '.join(failed)}"
        return line


_lock = threading.RLock()
_current: Optional[_Installation] = None
_job: Optional[JobSummary] = None


def _log_summary() -> None:
    """At exit, one line per job: versions and what was applied (see ``_summary``). Not built where
    it would not be printed (``TORCHPATCH_LOG=off``/``warning``): finding torch's version reads the
    file system, and exit is no place for work nobody reads."""
    inst = _current
    if (inst is not None and "torch" in sys.modules and _job is not None and _job.should_print()
            and log.isEnabledFor(logging.INFO)):
        log_summary(inst.summary())


def install(environ: Optional[Mapping[str, str]] = None) -> None:
    """Apply the catalogue to this process, whatever ``TORCHPATCH`` says; opt-outs still apply.

    Idempotent: the start-up hook, a sitecustomize and explicit calls together install once.
    Nothing is imported from torch here: each patch applies when its torch module is imported
    (or at once, if that module already is).
    """
    global _current, _job
    with _lock:
        _torchpatch_startup.cancel()
        if _current is not None:
            return
        cfg = Config.from_environ(os.environ if environ is None else environ)
        configure_logging(cfg.log_level)
        plans = plan(cfg=cfg, only_applicable=True)
        for warning in cfg.warnings:
            log.warning("%s", warning)
        inst = _Installation(cfg, plans)
        _current = inst
        try:
            inst.start()
        except Exception:
            _current = None
            inst.stop()
            raise
        if _job is None:
            _job = JobSummary()
        atexit.register(_log_summary)
        if cfg.report_dir:
            from . import _report

            _report.arm(inst)


def uninstall() -> None:
    """Take back everything :func:`install` did: finders, wrappers, served symbols and modules."""
    global _current
    with _lock:
        _torchpatch_startup.cancel()
        inst, _current = _current, None
        if inst is not None:
            atexit.unregister(_log_summary)
            inst.stop()


def is_installed() -> bool:
    """Whether torchpatch is active in this process: installed, or armed by ``TORCHPATCH=1`` and
    waiting for the first ``import torch``."""
    return _current is not None or _torchpatch_startup.pending()


def status() -> Dict[str, str]:
    """Patch id -> applied / not needed / failed / waiting for its module, for armed patches."""
    return dict(_current.status) if _current is not None else {}


def _activate_at_startup() -> None:
    """Called by the start-up hook at the first ``import torch`` when ``TORCHPATCH`` is on: never
    breaks the process unless ``TORCHPATCH_STRICT=1``, which makes a failure end it (exit 1)."""
    try:
        install()
    except Exception as exc:
        cfg = Config.from_environ()
        if cfg.strict:
            traceback.print_exc()
            raise SystemExit(f"torchpatch: activation failed: {type(exc).__name__}: {exc}") from exc
        if cfg.log_level != "off":
            sys.stderr.write(f"torchpatch: activation failed, continuing without torchpatch: {exc}\n")
