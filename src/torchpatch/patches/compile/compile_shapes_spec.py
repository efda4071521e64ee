"""compile-shapes-spec: ``torch.compile(shapes_spec=...)``, torch 2.13's name of ``dynamic_shapes``,
torch 2.14 and later.

What breaks:   code written for torch 2.13 that declares which dimensions are dynamic with
               ``torch.compile(fn, shapes_spec={"x": TensorSpec([ShapeVar("batch"), None])})`` (or a
               ``ShapesSpec``/``ParamsSpec``) dies on torch 2.14 and later with
               ``TypeError: compile() got an unexpected keyword argument 'shapes_spec'``.
Torch:         2.14 and later: the argument arrived in 2.13 and was renamed ``dynamic_shapes`` right
               after 2.13's branch cut, to match ``torch.export.export`` and ``make_fx``.
Fix:           ``torch.compile`` takes ``shapes_spec`` again and hands it on as ``dynamic_shapes``
               (same values, same meaning: the rename changed nothing else). Passing both is a
               ``TypeError``, as no torch accepted that. The decorator form
               (``@torch.compile(shapes_spec=...)``) goes through the same function.
Upstream:      https://github.com/pytorch/pytorch/pull/187010 (``shapes_spec`` renamed
               ``dynamic_shapes`` in torch.compile)
"""

from types import ModuleType
from typing import Any, Callable, Dict, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="compile-shapes-spec",
    summary="torch.compile(shapes_spec=...), torch 2.13's name of dynamic_shapes",
    torch=">=2.14",
    upstream="https://github.com/pytorch/pytorch/pull/187010",
    behaviour="torch.compile takes shapes_spec= (torch 2.13) as dynamic_shapes=",
    errors=(
        Error(r"unexpected keyword argument 'shapes_spec'",
              "TypeError: compile() got an unexpected keyword argument 'shapes_spec'"),
    ),
)


def _compile(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    if "shapes_spec" in kwargs:
        if "dynamic_shapes" in kwargs:
            raise TypeError("torch.compile() got both shapes_spec (its torch 2.13 name) and dynamic_shapes: pass one")
        kwargs["dynamic_shapes"] = kwargs.pop("shapes_spec")
    return wrapped(*args, **kwargs)


@PATCH.on_import("torch")
def compile_takes_shapes_spec(patcher: Patcher, torch: ModuleType) -> bool:
    import inspect

    parameters = inspect.signature(torch.compile).parameters
    if "shapes_spec" in parameters or "dynamic_shapes" not in parameters:
        return False
    patcher.wrap(torch, "compile", _compile)
    return True
