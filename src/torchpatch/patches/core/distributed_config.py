"""distributed-config: ``torch.distributed.config``, torch 2.4-2.10.

What breaks:   code written for torch >= 2.11 reads or patches torch.distributed's flags
               (``import torch.distributed.config as dist_config``; ``if dist_config.use_torchcomms:``;
               ``with dist_config.patch(use_torchcomms=False):``) and dies with
               ``ModuleNotFoundError: No module named 'torch.distributed.config'``.
Torch:         2.11 added the module (``compile_on_one_rank``, ``use_torchcomms``), 2.15 the flag
               ``pipeline_per_edge_p2p``; each switches on a feature that 2.4-2.10 do not have
               (compiling on one rank, the TorchComms backend, per-edge pipeline communicators).
Fix:           serve the module as a config module of this torch (``install_config_module``: the
               same ``patch``, ``save_config``, ``get_config_copy``, ...) holding torch 2.15's three
               flags, each ``False`` (their default there, and what this torch does). Turning one
               on, by assignment or ``patch``, raises ``RuntimeError`` naming the feature this torch
               lacks: a flag that nothing reads would otherwise be silently ignored. Their
               environment variables (``TORCH_DISTRIBUTED_USE_TORCHCOMMS``, ...) are not read, for
               the same reason.
Upstream:      https://github.com/pytorch/pytorch/blob/v2.11.0/torch/distributed/config.py
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, Dict

from torchpatch import Patch

PATCH = Patch(
    id="distributed-config",
    summary="torch.distributed.config (torch 2.15's flags, off; turning one on raises)",
    torch=">=2.4,<2.11",
    upstream="https://github.com/pytorch/pytorch/blob/v2.11.0/torch/distributed/config.py",
)

MODULE = "torch.distributed.config"
SOURCE = Path(__file__).with_name("_distributed_config.py")
# What each flag turns on, and the torch that brought it.
FEATURES = {
    "compile_on_one_rank": "one-rank compilation (torch 2.11)",
    "use_torchcomms": "the TorchComms communication backend (torch 2.11)",
    "pipeline_per_edge_p2p": "per-edge pipeline P2P communicators (torch 2.15)",
}


def _refuse_turning_on(changes: Dict[str, Any]) -> None:
    import torch

    for name, value in changes.items():
        if name in FEATURES and value:
            raise RuntimeError(f"{MODULE}.{name} = {value!r} on torch {torch.__version__} (served by torchpatch): "
                               f"this torch lacks {FEATURES[name]}")


def _guarded(config_class: type) -> type:
    """``config_class`` (the class ``install_config_module`` gave the module) refusing to turn a flag on."""

    class DistributedConfig(config_class):  # type: ignore[misc, valid-type]
        def __setattr__(self, name: str, value: Any) -> None:
            _refuse_turning_on({name: value})
            super().__setattr__(name, value)

        def patch(self, arg1: Any = None, arg2: Any = None, **kwargs: Any) -> Any:
            changes = dict(arg1) if isinstance(arg1, dict) else ({arg1: arg2} if arg1 is not None else {})
            _refuse_turning_on({**changes, **kwargs})
            return super().patch(arg1, arg2, **kwargs)

    return DistributedConfig


PATCH.sets(MODULE, tuple(FEATURES))


@PATCH.module(MODULE)
def build(module: ModuleType) -> None:
    from torch.utils._config_module import install_config_module

    module.__file__ = str(SOURCE)  # install_config_module reads the module's source for its comments
    exec(compile(SOURCE.read_text(), str(SOURCE), "exec"), module.__dict__)
    module.__all__ = list(FEATURES)
    install_config_module(module)
    ModuleType.__setattr__(module, "__class__", _guarded(type(module)))
