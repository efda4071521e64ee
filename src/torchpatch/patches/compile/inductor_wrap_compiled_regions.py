"""inductor-wrap-compiled-regions: ``torch.compile(options={"wrap_inductor_compiled_regions": ...})``,
torch 2.0-2.9.

What breaks:   code written for torch >= 2.10 that asks Inductor to make its compiled regions visible
               to dispatch modes (selective activation checkpointing, DebugMode), as torchtitan 0.2.2
               does at import for FlexAttention, dies at ``torch.compile`` with
               ``RuntimeError: Unexpected optimization option wrap_inductor_compiled_regions``.
Torch:         2.0 to 2.9: the Inductor config key came with torch 2.10.
Fix:           ``torch.compile`` accepts the key (a ``bool``, as torch checks: anything else is
               torch's ``RuntimeError: Unexpected type of attr``) and compiles without it. The key
               changes no computed value: on torch >= 2.10 it only routes the compiled code through
               the ``inductor_compiled_code`` operator while a dispatch mode is active, so that the
               mode sees the region; with no mode active the compiled code runs as is. Torch 2.0 to
               2.9 never runs compiled code under a (non-infrastructure) dispatch mode: Dynamo steps
               aside and the function runs eagerly, each of its operators seen by the mode. So a
               selective-checkpointing policy sees the region's own operators instead of one
               ``inductor_compiled_code``, and the values are those of the eager function. (Torch 2.4's
               checkpoint cannot recompute a compiled function under selective checkpointing, key or
               no key: "Detected that you are using FX to symbolically trace a dynamo-optimized
               function"; 2.9's can.) The key
               is not served as ``torch._inductor.config.wrap_inductor_compiled_regions``: setting
               it there stays an ``AttributeError``.
Upstream:      https://github.com/pytorch/pytorch/pull/167844 (HOP for Inductor compiled regions)
"""

from types import ModuleType
from typing import Any, Callable, Dict, Optional, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="inductor-wrap-compiled-regions",
    summary="torch.compile accepts options={'wrap_inductor_compiled_regions': bool} (torch 2.10's Inductor key)",
    torch=">=2.0,<2.10",
    upstream="https://github.com/pytorch/pytorch/pull/167844",
    behaviour="torch.compile accepts the Inductor option wrap_inductor_compiled_regions (same values)",
    errors=(
        Error(r'Unexpected optimization option wrap_inductor_compiled_regions',
              "RuntimeError: Unexpected optimization option wrap_inductor_compiled_regions, known options are ['TYPE_CHECKING', ..."),
    ),
)

KEY = "wrap_inductor_compiled_regions"


def _apply_options(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    options: Optional[Dict[str, Any]] = args[0] if args else kwargs.get("options")
    if not options or all(key.replace("-", "_") != KEY for key in options):
        return wrapped(*args, **kwargs)
    from torch._inductor import config  # as apply_options itself does

    if KEY in config.get_config_copy():
        return wrapped(*args, **kwargs)
    rest = {}
    for key, value in options.items():
        if key.replace("-", "_") != KEY:
            rest[key] = value
        elif not isinstance(value, bool):
            raise RuntimeError(f"Unexpected type of attr {key}, got {type(value).__name__} should be bool")
    return wrapped(rest)


@PATCH.on_import("torch")
def compile_accepts_wrap_key(patcher: Patcher, torch: ModuleType) -> bool:
    """Wraps the option check; the key itself is looked for there, as importing Inductor's config
    here would add seconds to ``import torch``."""
    patcher.wrap(torch._TorchCompileInductorWrapper, "apply_options", _apply_options)
    return True
