"""torch-load-weights-only-globals: ``torch.load``'s weights-only error lists everything the file needs
and says how to load it, torch 2.6 and later.

What breaks:   a training state that an older torch saved with ``torch.save`` (model and optimizer
               state dicts plus ``np.random.get_state()``, an ``argparse.Namespace``, a dataclass of
               config, ...) fails on torch 2.6+, where ``torch.load`` defaults to ``weights_only=True``,
               with ``_pickle.UnpicklingError: Weights only load failed. ... Unsupported global: GLOBAL
               argparse.Namespace was not an allowed global by default``. The message names only the
               first global the unpickler met: allowlisting it leads to the next error, one global at a
               time. Even the whole list of ``torch.serialization.get_unsafe_globals_in_checkpoint``
               (torch 2.5+) is not enough for numpy state: the unpickler also needs the class that
               ``numpy.dtype(...)`` builds (``numpy.dtypes.UInt32DType`` for the RNG state), which is
               no global of the file, and a file numpy 1.x wrote names
               ``numpy.core.multiarray._reconstruct``, which ``safe_globals([that function])`` does not
               match under numpy 2 (its ``__module__`` is ``numpy._core.multiarray``).
Torch:         2.6 and later (2.15 included): the default became ``weights_only=True`` in 2.6 and each
               message still names one global. Before 2.6 the default is ``False`` and such files load.
Fix:           nothing on success (the wrapper only calls ``torch.load``). When ``torch.load`` raises
               its weights-only ``UnpicklingError``, read the file's pickle again without running it
               (``pickletools`` and a model of the stack, which tells the class ``numpy.dtype``
               builds), list every global and built class this torch's allowlists (default and
               ``safe_globals``) lack, and append to the same exception's message (the native one
               kept first) the list and the two ways to load the file:
               ``with torch.serialization.safe_globals([...]): torch.load(...)`` with importable names
               (``(object, "name in the file")`` where numpy renamed the module), if the user trusts
               those classes; ``weights_only=False`` only if they trust the file. The default stays
               ``weights_only=True``: nothing is allowlisted and no code of the file runs.
Upstream:      https://github.com/pytorch/pytorch/pull/137602 (default ``weights_only=True``, torch
               2.6); https://github.com/pytorch/pytorch/issues/129698 (all globals in one call);
               https://github.com/pytorch/pytorch/pull/134346 (types built by REDUCE are no GLOBAL);
               https://github.com/pytorch/pytorch/pull/142153 (``(global, "module.name")`` for numpy's
               ``numpy.core`` rename)
"""

import io
import os
import pickle
import pickletools
import re
import sys
import warnings
import zipfile
from types import ModuleType
from typing import Any, Dict, List, Optional, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="torch-load-weights-only-globals",
    summary="torch.load's weights-only error lists every global the file needs and the two ways to load it",
    torch=">=2.6",
    upstream="https://github.com/pytorch/pytorch/pull/137602",
    behaviour="torch.load's weights-only UnpicklingError lists all the file's missing globals and how to load it",
)

MARKER = "torchpatch:"
# numpy.dtype(...) is evaluated (to learn the class it builds) only on a plain type code such as 'u4', 'f8', 'M8'.
_DTYPE_CODE = re.compile(r"^[<>=|]?[A-Za-z][0-9]{0,3}$")


class _Built:
    """An object the pickle builds (a container, an instance, a storage)."""


class _Global:
    def __init__(self, name: str):
        self.name = name


_MARK = object()
# The opcodes that push a constant (None, a bool, a number, a string, bytes): their value is genops' argument.
_CONSTANTS: Dict[str, Any] = dict.fromkeys(
    "INT BININT BININT1 BININT2 LONG LONG1 LONG4 FLOAT BINFLOAT STRING BINSTRING SHORT_BINSTRING BINBYTES "
    "SHORT_BINBYTES BINBYTES8 BYTEARRAY8 UNICODE SHORT_BINUNICODE BINUNICODE BINUNICODE8".split())
_CONSTANTS.update(NONE=None, NEWTRUE=True, NEWFALSE=False)


def _data_pkl(f: Any) -> Optional[bytes]:
    """The bytes of the archive's ``data.pkl`` (only the archive's directory and that record are read), or
    None: not a zip archive (torch's legacy format), or a file object that cannot seek."""
    if isinstance(f, (str, os.PathLike)):
        with open(f, "rb") as opened:
            return _record(opened)
    if not all(hasattr(f, name) for name in ("seek", "tell", "read")):
        return None
    position = f.tell()
    try:
        return _record(f)
    finally:
        f.seek(position)


def _record(opened: Any) -> Optional[bytes]:
    if not zipfile.is_zipfile(opened):
        return None
    with zipfile.ZipFile(opened) as archive:
        names = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        return archive.read(names[0]) if names else None


def _mapped(module: str, name: str) -> str:
    """The name the weights-only unpickler looks up (Python 2 names mapped as torch maps them)."""
    from torch._utils import IMPORT_MAPPING, NAME_MAPPING

    if (module, name) in NAME_MAPPING:
        module, name = NAME_MAPPING[(module, name)]
    elif module in IMPORT_MAPPING:
        module = IMPORT_MAPPING[module]
    return f"{module}.{name}"


def _dtype_class(args: Any) -> Optional[type]:
    """The class ``numpy.dtype(*args)`` builds, for a plain type code, without other code of the file."""
    numpy = sys.modules.get("numpy")
    if numpy is None or not isinstance(args, tuple) or not args or not isinstance(args[0], str):
        return None
    if not _DTYPE_CODE.match(args[0]):
        return None
    try:
        return type(numpy.dtype(args[0]))
    except Exception:
        return None


def needed(pkl: bytes) -> Tuple[List[str], Dict[str, type]]:
    """Every global the pickle names (in order of first use, as the unpickler maps them) and the classes
    of objects that ``numpy.dtype`` builds in it (by name): read with ``pickletools``, nothing run."""
    names: List[str] = []
    built: Dict[str, type] = {}
    stack: List[Any] = []
    memo: Dict[Any, Any] = {}
    modelled = True
    for op, arg, _pos in pickletools.genops(pkl):
        if op.name == "GLOBAL":
            module, _, attr = arg.partition(" ")
            arg = _mapped(module, attr)
            if arg not in names:
                names.append(arg)
        if modelled:
            try:
                modelled = _step(op.name, arg, stack, memo, names, built)
            except IndexError:  # a stack the model does not follow: the GLOBALs are still all read
                modelled = False
    return names, built


def _step(name: str, arg: Any, stack: List[Any], memo: Dict[Any, Any], names: List[str], built: Dict[str, type]) -> bool:
    """Apply one opcode to the model of the unpickler's stack: False for an opcode it does not model."""

    def pop_mark() -> List[Any]:
        items = []
        while stack[-1] is not _MARK:
            items.append(stack.pop())
        stack.pop()
        return items[::-1]

    if name == "GLOBAL":
        stack.append(_Global(arg))
    elif name == "STACK_GLOBAL":
        attr, module = stack.pop(), stack.pop()
        if not (isinstance(module, str) and isinstance(attr, str)):
            return False
        full = _mapped(module, attr)
        if full not in names:
            names.append(full)
        stack.append(_Global(full))
    elif name == "MARK":
        stack.append(_MARK)
    elif name in ("PROTO", "FRAME", "STOP", "READONLY_BUFFER"):
        pass
    elif name in _CONSTANTS:
        stack.append(_CONSTANTS[name] if name in ("NONE", "NEWTRUE", "NEWFALSE") else arg)
    elif name == "EMPTY_TUPLE":
        stack.append(())
    elif name in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "PERSID", "EXT1", "EXT2", "EXT4", "NEXT_BUFFER"):
        stack.append(_Built())
    elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
        count = int(name[-1])
        items = tuple(stack[-count:])
        if len(items) != count:
            return False
        del stack[-count:]
        stack.append(items)
    elif name == "TUPLE":
        stack.append(tuple(pop_mark()))
    elif name in ("LIST", "DICT", "FROZENSET", "OBJ", "INST"):
        pop_mark()
        stack.append(_Built())
    elif name in ("APPENDS", "SETITEMS", "ADDITEMS", "POP_MARK"):
        pop_mark()
    elif name in ("APPEND", "POP", "BUILD"):
        stack.pop()
    elif name == "SETITEM":
        stack.pop()
        stack.pop()
    elif name == "DUP":
        stack.append(stack[-1])
    elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
        memo[arg] = stack[-1]
    elif name == "MEMOIZE":
        memo[len(memo)] = stack[-1]
    elif name in ("GET", "BINGET", "LONG_BINGET"):
        stack.append(memo.get(arg))
    elif name == "BINPERSID":
        stack.pop()
        stack.append(_Built())
    elif name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX"):
        args, func = stack.pop(), stack.pop()
        if name == "NEWOBJ_EX":
            stack.pop()
        elif name == "REDUCE" and isinstance(func, _Global) and func.name == "numpy.dtype":
            made = _dtype_class(args)
            if made is not None:
                built.setdefault(f"{made.__module__}.{made.__qualname__}", made)
        stack.append(_Built())
    else:
        return False
    return True


def _resolve(name: str) -> Tuple[Any, str]:
    """``(the object, its module's name)`` that ``name`` names among the modules already imported, or
    ``(None, a guess of the module's name)``. No module is imported here; an attribute lookup may run an
    imported package's lazy ``__getattr__`` (numpy's loads ``numpy.core`` so), its warnings silenced."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        obj: Any = sys.modules.get(module)
        if obj is None:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
        except Exception:
            return None, module
        return obj, module
    return None, name.rpartition(".")[0]


def _expression(name: str, obj: Any, module: str) -> Tuple[str, str, str]:
    """``(what to pass to safe_globals, the module to import for it, a note)`` for the global ``name``."""
    if name.startswith("__main__."):
        attr = name[len("__main__."):]
        return f'({attr}, "{name}")', "", f"defined in the script that saved the file: define or import {attr} in yours"
    if obj is None:
        return name, module, ""
    own_module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    own = f"{own_module}.{qualname}"
    if own == name:
        return name, module, ""
    # the object calls itself by another name than the file (numpy.core -> numpy._core): the tuple form
    if isinstance(own_module, str) and _resolve(own)[0] is obj:
        return f'({own}, "{name}")', own_module, f"the file's name of {own}"
    return f'({name}, "{name}")', module, f"its own name here is {own}"


def explanation(f: Any, message: str) -> Optional[str]:
    """What torchpatch appends to the weights-only error of ``torch.load(f)``, or None."""
    from torch import _weights_only_unpickler as unpickler

    pkl = _data_pkl(f)
    if pkl is None:
        return None
    names, built = needed(pkl)
    allowed = set(unpickler._get_allowed_globals()) | set(unpickler._get_user_allowed_globals())
    allowed_objects = list(unpickler._get_allowed_globals().values()) + list(unpickler._get_user_allowed_globals().values())
    missing = sorted(n for n in names if n not in allowed)
    missing_built = sorted(n for n, cls in built.items() if n not in missing and not any(cls is o for o in allowed_objects))
    if not missing and not missing_built:
        return None
    blocked = sorted(n for n in missing if n.rpartition(".")[0] in getattr(unpickler, "_blocklisted_modules", ()))
    target = repr(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else "f"
    count = len(missing) + len(missing_built)
    lines = ["", "", f"{MARKER} read without running it, the file needs {count} "
             f"{'class or function' if count == 1 else 'classes and functions'} that torch.load(weights_only=True) "
             "does not allow here (torch's message above names one at most):"]
    expressions, modules = [], set()
    for name in missing + missing_built:
        obj, module = _resolve(name) if name in missing else (built[name], built[name].__module__)
        expression, module, note = _expression(name, obj, module)
        notes = [note] if note else []
        if name in missing_built:
            notes.append("no global of the file: the class numpy.dtype(...) builds in it, which BUILD needs allowed")
        if name in blocked:
            notes.append("its module is blocked: no allowlist admits it")
        lines.append(f"    {name}" + (f"  ({'; '.join(notes)})" if notes else ""))
        expressions.append(expression)
        if module:
            modules.add(module)
    lines.append("Two ways to load it:")
    operand = re.search(r"Unsupported operand (\d+)", message)
    if blocked:
        lines.append(f"  (1) with weights_only=True: not possible, no allowlist admits {', '.join(blocked)}")
    elif operand:
        lines.append(f"  (1) with weights_only=True: not possible, this torch's weights-only unpickler cannot read the "
                     f"pickle opcode {operand.group(1)} (a file saved with a pickle_protocol above 2)")
    else:
        lines += ["  (1) if you trust these classes and functions (their code runs while loading; all else stays restricted):",
                  f"        import {', '.join(['torch'] + sorted(modules))}",
                  f"        with torch.serialization.safe_globals([{', '.join(expressions)}]):",
                  f"            state = torch.load({target})"]
    forced = os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true")
    lines.append(f"  (2) only if you trust the file itself (unpickling it can run any code): "
                 f"state = torch.load({target}, weights_only=False)"
                 + ("  (TORCH_FORCE_WEIGHTS_ONLY_LOAD is set here: unset it first)" if forced else ""))
    if target == "f":
        lines.append("  (f: the file object, put back where the checkpoint starts)")
    return "\n".join(lines)


def _load(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    try:
        return wrapped(*args, **kwargs)
    except pickle.UnpicklingError as exc:
        message = str(exc)
        if message.startswith("Weights only load failed") and MARKER not in message and len(exc.args) == 1:
            try:
                extra = explanation(args[0] if args else kwargs.get("f"), message)
            except Exception as failure:  # the native error stands; say why nothing was added
                extra = f"\n\n{MARKER} could not list the file's globals ({type(failure).__name__}: {failure})"
            if extra:
                exc.args = (message + extra,)
        raise


@PATCH.on_import("torch")
def explain_weights_only_errors(patcher: Patcher, torch: ModuleType) -> bool:
    serialization = torch.serialization
    if not hasattr(serialization, "safe_globals"):
        return False
    patcher.wrap(torch, "load", _load)
    patcher.wrap(serialization, "load", _load)
    return True
