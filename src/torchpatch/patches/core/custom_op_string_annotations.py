"""custom-op-string-annotations: ``torch.library.custom_op`` on a function whose annotations are
strings (``from __future__ import annotations``), torch 2.4.

What breaks:   a module that defines custom ops under ``from __future__ import annotations`` (the
               spmd_types package, which torchtitan 0.3 imports at start) dies at import with
               ``ValueError: infer_schema(func): Parameter x has unsupported type torch.Tensor. The
               valid types are: ...``: the annotation is the string ``'torch.Tensor'``, not the type.
Torch:         2.4's ``infer_schema`` looks the annotation up as it is; 2.5 evaluates a string
               annotation (also inside a generic such as ``Optional['torch.Tensor']``) with the
               function's globals first.
Fix:           before this torch's ``infer_schema`` reads the signature, each string annotation is
               evaluated as 2.5 does (the function's globals; one that does not evaluate raises 2.15's
               ``ValueError: ... Unsupported type annotation X. It is not a type. (why) ...``); the schema is
               then this torch's, from the evaluated types. Functions without string annotations
               are passed through untouched.
Upstream:      https://github.com/pytorch/pytorch/tree/v2.5.0/torch/_library/infer_schema.py
"""

import inspect
import typing
from types import ModuleType
from typing import Any, Callable, Dict, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="custom-op-string-annotations",
    summary="torch.library.custom_op / infer_schema read string annotations (from __future__ import annotations), "
            "evaluated with the function's globals as torch 2.5",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/tree/v2.5.0/torch/_library/infer_schema.py",
    behaviour="infer_schema(func) of string annotations",
    errors=(  # a string annotation prints bare; a real unsupported type as <class ...> or typing.X
        Error(r"infer_schema\(func\): (Parameter \w+|Return) has unsupported type (?!<class )(?!typing\.)",
              "ValueError: infer_schema(func): Parameter x has unsupported type torch.Tensor. The valid types "
              "are: ..."),
    ),
)


def _resolve(annotation: Any, scope: Dict[str, Any], sig: inspect.Signature) -> Tuple[Any, bool]:
    """The annotation with each string in it evaluated in ``scope``; whether anything changed."""
    if isinstance(annotation, str):
        try:
            return eval(annotation, scope), True  # noqa: S307 - what Python itself does for a string annotation
        except NameError as exc:
            why = (f"({exc}). If you are using 'from __future__ import annotations', note that annotations are "
                   "evaluated lazily as strings; make sure all types referenced in annotations are importable at "
                   "module scope, not only inside a local function.")
        except Exception as exc:
            why = f"({type(exc).__name__}: {exc})"
        raise ValueError(f"infer_schema(func): Unsupported type annotation {annotation}. It is not a type. {why} "
                         f"Got func with signature {sig})")
    origin = typing.get_origin(annotation)
    if origin is None:
        return annotation, False
    resolved = [_resolve(arg, scope, sig) for arg in typing.get_args(annotation)]
    if not any(changed for _, changed in resolved):
        return annotation, False
    args = tuple(arg for arg, _ in resolved)
    if origin is typing.Union:
        return typing.Union[args], True
    # typing.List[...] / Sequence[...] keep their typing form, which the schema table is keyed by
    alias = getattr(typing, getattr(annotation, "_name", "") or "", None)
    if alias is not None:
        return alias[args if len(args) > 1 else args[0]], True
    return type(annotation)(origin, args), True  # list[...] and the like: types.GenericAlias (3.9+)


def _with_types(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` itself, or (where an annotation is a string) a stand-in whose signature has the types."""
    sig = inspect.signature(func)
    scope = getattr(inspect.unwrap(func), "__globals__", {})
    changed = False
    params = []
    for param in sig.parameters.values():
        annotation, param_changed = _resolve(param.annotation, scope, sig)
        params.append(param.replace(annotation=annotation))
        changed |= param_changed
    result, result_changed = _resolve(sig.return_annotation, scope, sig)
    if not (changed or result_changed):
        return func

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    stand_in.__signature__ = sig.replace(parameters=params, return_annotation=result)  # type: ignore[attr-defined]
    stand_in.__name__ = getattr(func, "__name__", "stand_in")
    return stand_in


def _infer_schema(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    if args:
        return wrapped(_with_types(args[0]), *args[1:], **kwargs)
    if "prototype_function" in kwargs:
        kwargs = dict(kwargs, prototype_function=_with_types(kwargs["prototype_function"]))
    return wrapped(*args, **kwargs)


def _wrap_name(patcher: Patcher, module: ModuleType) -> bool:
    if getattr(module, "infer_schema", None) is None:
        return False
    patcher.wrap(module, "infer_schema", _infer_schema)
    return True


# the function's home and the two modules that bind it by name (custom_op calls torch._custom_op.impl's)
for _home in ("torch._library.infer_schema", "torch._custom_op.impl", "torch._custom_ops"):
    PATCH.on_import(_home)(_wrap_name)
