"""checkpoint-modules: distributed checkpointing (``torch.distributed.checkpoint``) where it is
missing or incomplete, torch 1.13-2.1.

What breaks:   torchtitan-era checkpointing code imports, at module load,
               ``import torch.distributed.checkpoint as dcp``,
               ``from torch.distributed.checkpoint.state_dict import get_model_state_dict, ...,
               StateDictOptions`` and ``from torch.distributed.checkpoint.stateful import Stateful``
               and calls ``dcp.save(state, checkpoint_id=path)`` / ``dcp.load(...)``:
               - torch 1.13: ``ModuleNotFoundError: No module named 'torch.distributed.checkpoint'``
                 (the package lives at ``torch.distributed._shard.checkpoint``);
               - torch 2.1: ``ModuleNotFoundError: No module named
                 'torch.distributed.checkpoint.state_dict'`` (and ``...stateful``), and
                 ``AttributeError: module 'torch.distributed.checkpoint' has no attribute 'save'``.
Torch:         1.13 (the package under its old path); 2.0 and 2.1 (torch 2.2 brought
               ``state_dict``, ``stateful`` and ``save``/``load``): nothing is served from 2.2 on.
Fix:           - 1.13: serve ``torch.distributed.checkpoint`` as the very module
                 ``torch.distributed._shard.checkpoint`` (its submodules follow: ``filesystem``,
                 ``planner``, ``metadata``, ... are the same objects under both names).
               - ``checkpoint.state_dict``: ``StateDictOptions`` and the get/set model, optimizer
                 and combined state-dict functions with upstream's semantics for plain and DDP
                 (and ``torch.compile``d / activation-checkpoint-wrapped) models on one process or
                 on replicated ranks: canonical FQN keys (no ``module.`` prefix), optimizer state
                 keyed by parameter FQN (optimizer state initialised by a zero-lr step when empty,
                 so that a checkpoint can load into it in place), ``full_state_dict``,
                 ``cpu_offload`` (with both, ranks other than 0 get ``{}``), ``ignore_frozen_params``,
                 ``strict``, ``broadcast_from_rank0`` and ``flatten_optimizer_state_dict``. FSDP,
                 DTensor and ShardedTensor parameters need the resharding machinery of torch >= 2.2:
                 they raise ``NotImplementedError`` saying so.
               - ``checkpoint.stateful.Stateful``: the runtime-checkable Protocol.
               - ``dcp.save(state_dict, checkpoint_id=... | storage_writer=...)`` and
                 ``dcp.load(...)`` (also in ``state_dict_saver`` / ``state_dict_loader``) on top of
                 the installed ``save_state_dict`` / ``load_state_dict`` and ``FileSystemWriter`` /
                 ``FileSystemReader``, calling ``state_dict()`` / ``load_state_dict()`` on
                 ``Stateful`` values like upstream. Served where the installed planners flatten
                 nested state dicts (torch >= 2.0); 1.13's cannot, so 1.13 gets the alias and the
                 two modules but no ``save``/``load``.
Upstream:      https://github.com/pytorch/pytorch/pull/112203 (get/set model and optimizer state_dict),
               https://github.com/pytorch/pytorch/pull/113867 (dcp.save/dcp.load and Stateful)
"""

from __future__ import annotations

import functools
import gc
import inspect
import os
import warnings
from dataclasses import asdict, dataclass, field, replace
from itertools import chain
from types import ModuleType
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Protocol, Set, Tuple, Union, runtime_checkable

from torchpatch import Patch, Patcher

if TYPE_CHECKING:  # only for annotations: torch is never imported at this module's top level
    import torch
    from torch import nn

PATCH = Patch(
    id="checkpoint-modules",
    summary="torch.distributed.checkpoint where it is missing (1.13), its state_dict, stateful, save and load "
    "where they are (2.0-2.1)",
    torch=">=1.13,<2.2",
    upstream="https://github.com/pytorch/pytorch/pull/112203",
    requires=("py311-dataclass-defaults",),  # 1.13's _shard package only imports with it on Python 3.11
    behaviour="torch.distributed.checkpoint.save/load (also in state_dict_saver/state_dict_loader)",
)

PATCH.alias("torch.distributed.checkpoint", "torch.distributed._shard.checkpoint", torch="<2.0")
PATCH.sets("torch.distributed.checkpoint", ("save", "load"), torch=">=2.0")  # by serve_save_and_load
PATCH.sets("torch.distributed.checkpoint.state_dict_saver", ("save",), torch=">=2.0")
PATCH.sets("torch.distributed.checkpoint.state_dict_loader", ("load",), torch=">=2.0")

_STATE, _PG, _PARAMS = "state", "param_groups", "params"
_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."
_EXTRA_STATE = "_extra_state"


# -- checkpoint.stateful ------------------------------------------------------------------------
@runtime_checkable
class Stateful(Protocol):
    """Stateful protocol for objects that can be checkpointed and restored."""

    def state_dict(self) -> Dict[str, Any]:
        """The object's state as a dictionary; ``dcp.load`` calls it too, to load in place."""
        ...

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore the object's state from ``state_dict``."""
        ...


PATCH.sets("torch.distributed.checkpoint.stateful", ("Stateful",))


@PATCH.module("torch.distributed.checkpoint.stateful")
def build_stateful(module: ModuleType) -> None:
    module.Stateful = Stateful
    module.__all__ = ["Stateful"]


# -- checkpoint.state_dict ----------------------------------------------------------------------
@dataclass
class StateDictOptions:
    """How the get/set state-dict functions work (upstream's fields and defaults).

    - ``full_state_dict``: tensors are returned whole (for this torch's plain/replicated tensors
      they already are).
    - ``cpu_offload``: tensors are moved to CPU; with ``full_state_dict`` too, ranks other than 0
      get an empty state_dict.
    - ``ignore_frozen_params``: leave out parameters with ``requires_grad=False``.
    - ``keep_submodule_prefixes`` (deprecated): with ``submodules``, keep their prefix in keys.
    - ``strict``: the ``strict`` of ``model.load_state_dict``.
    - ``broadcast_from_rank0``: rank 0 holds the full state_dict and broadcasts each value to the
      other ranks; needs ``full_state_dict``.
    - ``flatten_optimizer_state_dict``: optimizer state as ``state.<fqn>.<name>`` and
      ``param_groups.<fqn>.<key>`` entries.
    - ``dsd_fqn_modifiers``: the name of a module method renaming FQNs (not supported here).
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    keep_submodule_prefixes: bool = True
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False
    dsd_fqn_modifiers: str = "_fqn_modifiers"


@dataclass
class _StateDictInfo(StateDictOptions):
    fqns_of_param: Dict[Any, List[str]] = field(default_factory=dict)  # parameter -> its FQNs
    shared_fqns: Set[str] = field(default_factory=set)
    submodule_prefixes: Set[str] = field(default_factory=set)
    handle_model: bool = True
    handle_optim: bool = True


def _no_shim_support(what: str) -> NotImplementedError:
    import torch

    return NotImplementedError(
        f"torch.distributed.checkpoint.state_dict (served by torchpatch on torch {torch.__version__}) "
        f"handles plain and DDP models with replicated tensors; {what} needs the resharding "
        "support of the native implementation (torch >= 2.2)"
    )


def _check_supported(model: "nn.Module", options: StateDictOptions) -> None:
    """Raise for what only the native implementation can do (sharded parameters, FQN modifiers)."""
    for module in model.modules():
        if any(c.__name__ == "FullyShardedDataParallel" for c in type(module).__mro__):
            raise _no_shim_support("an FSDP model")
        if hasattr(module, options.dsd_fqn_modifiers):
            raise _no_shim_support(f"a module with {options.dsd_fqn_modifiers}()")
    for name, tensor in chain(model.named_parameters(), model.named_buffers()):
        kinds = {c.__name__ for c in type(tensor).__mro__}
        sharded = kinds & {"FlatParameter", "DTensor", "ShardedTensor"}
        if sharded:
            raise _no_shim_support(f"a {sharded.pop()} ({name!r})")


def _is_compiled(module: Any) -> bool:
    return type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod")


def _get_fqn(model: "nn.Module", name: str) -> str:
    """The canonical FQN of a state_dict key: without DDP's ``module.``, ``torch.compile``'s
    ``_orig_mod.`` and the activation-checkpoint wrapper's prefix."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    parts = name.replace(_CHECKPOINT_PREFIX, "").split(".")
    out: List[str] = []
    obj: Any = model
    for i, part in enumerate(parts):
        if isinstance(obj, DDP) and part == "module":
            obj = obj.module
        elif _is_compiled(obj) and part == "_orig_mod":
            obj = obj._orig_mod
        else:
            out.append(part)
            if part == _EXTRA_STATE and i == len(parts) - 1:
                break
            obj = getattr(obj, part, None)
    return ".".join(out)


def _gc_free(fn: Any) -> Any:
    """Run ``fn`` with the garbage collector off, as upstream does for these calls."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return run


def _all_named_parameters(module: "nn.Module", prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """Every name of every parameter, shared ones under each of their names (torch 1.13's
    ``named_parameters`` has no ``remove_duplicate=False``)."""
    for name, param in module._parameters.items():
        if param is not None:
            yield prefix + name, param
    for name, child in module._modules.items():
        if child is not None:
            yield from _all_named_parameters(child, f"{prefix}{name}.")


def _verify_options(model: "nn.Module", optims: Tuple[Any, ...], optim_only: bool, *,
                    submodules: Optional[Set["nn.Module"]] = None,
                    options: Optional[StateDictOptions] = None) -> _StateDictInfo:
    if submodules:
        warnings.warn(
            "Getting submodules only model/optim state_dict is deprecated and will be removed in 2.5. "
            "This feature can be achieved by manually filtering out the state_dict returned from "
            "get_state_dict.", FutureWarning, stacklevel=3,
        )
    if optim_only and not optims:
        raise RuntimeError("Optimizers are not passed in but optim_only is set to True.")
    options = options or StateDictOptions()
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError("full_state_dict must be True when broadcast_from_rank0 is True.")
    _check_supported(model, options)

    fqns_of_param: Dict[Any, List[str]] = {}
    for name, param in _all_named_parameters(model):
        fqns_of_param.setdefault(param, []).append(_get_fqn(model, name))
    shared = {fqn for fqns in fqns_of_param.values() if len(fqns) > 1 for fqn in fqns}
    prefixes: Set[str] = set()
    if submodules:
        prefixes = {f"{_get_fqn(model, name)}." for name, m in model.named_modules() if m in submodules}
    return _StateDictInfo(**asdict(options), fqns_of_param=fqns_of_param, shared_fqns=shared,
                          submodule_prefixes=prefixes, handle_model=not optim_only,
                          handle_optim=len(optims) > 0)


def _is_distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _map_tensors(obj: Any, fn: Any) -> Any:
    """``obj`` rebuilt with ``fn`` applied to every tensor in its dicts, lists and tuples."""
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def _maybe_full_or_cpu(state_dict: Dict[str, Any], info: _StateDictInfo) -> Dict[str, Any]:
    import torch.distributed as dist

    if info.full_state_dict and info.cpu_offload and _is_distributed() and dist.get_rank() != 0:
        return {}
    if info.cpu_offload:
        return _map_tensors(state_dict, lambda t: t.to("cpu"))
    return state_dict


def _verify_state_dict(model_state_dict: Dict[str, Any], optim_state_dict: Dict[str, Any],
                       info: _StateDictInfo) -> None:
    if (info.handle_model and not model_state_dict and not info.submodule_prefixes
            and not info.ignore_frozen_params and not (info.cpu_offload and info.full_state_dict)
            and info.strict and not info.broadcast_from_rank0):
        raise RuntimeError("The option indicates that model state_dict is required to save or load, "
                           "but model state_dict is empty.")
    if (info.handle_optim and not optim_state_dict
            and not (info.cpu_offload and info.full_state_dict) and not info.broadcast_from_rank0):
        raise RuntimeError("The option indicates that model state_dict is required to save, or load "
                           f"but optim state_dict is empty. {optim_state_dict}")


def _get_model_state_dict(model: "nn.Module", info: _StateDictInfo) -> Dict[str, Any]:
    import torch

    if not info.handle_model:
        return {}
    with torch.no_grad():
        native = model.state_dict()
    state_dict = {_get_fqn(model, key): value for key, value in native.items()}
    if info.submodule_prefixes:
        kept = {}
        for fqn, value in state_dict.items():
            for prefix in info.submodule_prefixes:
                if fqn.startswith(prefix):
                    kept[fqn if info.keep_submodule_prefixes else fqn[len(prefix):]] = value
        state_dict = kept
    if info.ignore_frozen_params:
        for name, param in model.named_parameters():
            if not param.requires_grad:
                state_dict.pop(_get_fqn(model, name), None)
    return _maybe_full_or_cpu(state_dict, info)


def _broadcast_from_rank0(full: Dict[str, Any], local: Dict[str, Any], strict: bool) -> None:
    """Rank 0's ``full`` values into ``local`` on every rank, one tensor at a time (upstream's
    ``_broadcast_state_dict`` for plain tensors). ``strict`` drops local keys rank 0 lacks."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    layout: Dict[str, Any] = {}
    if rank == 0:
        for key, value in full.items():
            if not torch.is_tensor(value):
                layout[key] = value
            elif value.dim() == 0:
                layout[key] = value.cpu()
            else:
                layout[key] = ("tensor", tuple(value.size()), value.dtype)
    box = [layout]
    dist.broadcast_object_list(box, src=0)
    layout = box[0]
    for key, value in layout.items():
        if isinstance(value, tuple) and len(value) == 3 and value[0] == "tensor":
            local_value = local.get(key)
            device = local_value.device if torch.is_tensor(local_value) else torch.device("cpu")
            received = full[key].detach().to(device).clone() if rank == 0 else torch.empty(value[1], dtype=value[2], device=device)
            dist.broadcast(received, src=0)
            value = received
        if key in local:
            local[key] = value
    if strict:
        for key in set(local) - set(layout):
            local.pop(key)


def _load_model_state_dict(model: "nn.Module", state_dict: Dict[str, Any], info: _StateDictInfo) -> Any:
    import torch
    from torch.nn.modules.module import _IncompatibleKeys

    if not info.handle_model or (not state_dict and not info.broadcast_from_rank0):
        return _IncompatibleKeys([], [])
    state_dict = dict(state_dict)
    local: Dict[str, Any] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        fqn = _get_fqn(model, key)
        if fqn != key and state_dict:
            if fqn in state_dict:
                state_dict[key] = state_dict.pop(fqn)
            elif info.strict:
                raise RuntimeError(f"Missing key: {fqn}.")
        local[key] = value
    if info.broadcast_from_rank0:
        _broadcast_from_rank0(state_dict, local, info.strict)
        state_dict.update(local)
    with torch.no_grad():
        return model.load_state_dict(state_dict, strict=info.strict)


def _init_optim_state(optim: "torch.optim.Optimizer") -> None:
    """Give an optimizer without state its state, by one ``step()`` on zero gradients at lr 0."""
    import torch

    if optim.state:
        return
    if any(p.grad is not None for g in optim.param_groups for p in g[_PARAMS]):
        return
    for group in optim.param_groups:
        for param in group[_PARAMS]:
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    lrs = []
    for group in optim.param_groups:
        if "lr" in group:
            lrs.append(group["lr"])
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optim.step(closure=None)
    for group in optim.param_groups:
        if "lr" in group:
            group["lr"] = lrs.pop(0)
    optim.zero_grad(set_to_none=True)


def _flatten_optim_state_dict(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """``{"state": {fqn: {name: v}}, "param_groups": [...]}`` as ``state.<fqn>.<name>`` and
    ``param_groups.<fqn>.<key>`` entries (nested state dicts flatten further)."""
    import torch

    def flatten(nested: Dict[Any, Any], prefix: str) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for key, value in nested.items():
            full_key = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, dict):
                out.update(flatten(value, full_key))
            elif isinstance(value, (torch.Tensor, int, float)):
                out[full_key] = value
            else:
                raise NotImplementedError("Flattening optimizer state_dict only supports tensor, int, "
                                          f"float, dict states now. Type is {type(value)}.")
        return out

    ret: Dict[str, Any] = {}
    for fqn, state in state_dict[_STATE].items():
        ret.update(flatten(state, f"{_STATE}.{fqn}"))
    for group in state_dict[_PG]:
        fqns = group.pop(_PARAMS)
        for fqn in fqns:
            for key, value in group.items():
                ret[f"{_PG}.{fqn}.{key}"] = value
    return ret


def _unflatten_optim_state_dict(optim: "torch.optim.Optimizer", state_dict: Dict[str, Any],
                                info: _StateDictInfo) -> Dict[str, Any]:
    """The inverse of :func:`_flatten_optim_state_dict` for the parameters of ``optim``."""

    def nested(prefix: str) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for key, value in state_dict.items():
            if not key.startswith(prefix + "."):
                continue
            parts = key[len(prefix) + 1:].split(".")
            node = out
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
        return out

    state: Dict[str, Any] = {}
    groups: List[Dict[str, Any]] = []
    for group in optim.param_groups:
        groups.append({_PARAMS: []})
        for param in group[_PARAMS]:
            for fqn in info.fqns_of_param[param]:
                if fqn in info.shared_fqns and not any(
                        f"{_PG}.{fqn}.{k}" in state_dict for k in group if k != _PARAMS):
                    continue
                groups[-1][_PARAMS].append(fqn)
                if not param.requires_grad:
                    continue
                state[fqn] = {}
                for name in optim.state[param]:
                    key = f"{_STATE}.{fqn}.{name}"
                    state[fqn][name] = state_dict[key] if key in state_dict else nested(key)
        first = groups[-1][_PARAMS][0]
        for key in group:
            if key == _PARAMS:
                continue
            value = state_dict[f"{_PG}.{first}.{key}"]
            if key not in groups[-1]:
                groups[-1][key] = value
            elif groups[-1][key] != value:
                raise RuntimeError("All the parameters in the same parameter group should have the same "
                                   f"saved param_group value. But {first}.{key} is {value} while "
                                   f"other(s) is {groups[-1][key]}.")
    return {_STATE: state, _PG: groups}


def _get_optim_state_dict(model: "nn.Module", optims: Tuple[Any, ...], info: _StateDictInfo) -> Dict[str, Any]:
    import torch

    if not info.handle_optim:
        return {}
    fqn_of = {param: fqns[0] for param, fqns in info.fqns_of_param.items()}
    combined: Dict[str, Any] = {_STATE: {}, _PG: []}
    with torch.no_grad():
        for optim in optims:
            _init_optim_state(optim)
            osd = optim.state_dict()
            params = list(chain.from_iterable(g[_PARAMS] for g in optim.param_groups))
            missing = [i for i, p in enumerate(params) if p not in fqn_of]
            if missing:
                raise RuntimeError(f"The optimizer holds parameters (indices {missing}) that are not "
                                   "parameters of the model.")
            fqn_of_pid = {i: fqn_of[p] for i, p in enumerate(params)}
            combined[_STATE].update({fqn_of_pid[pid]: value for pid, value in osd[_STATE].items()})
            for group in osd[_PG]:
                group[_PARAMS] = [fqn_of_pid[pid] for pid in group[_PARAMS]]
                combined[_PG].append(group)
    if info.flatten_optimizer_state_dict:
        combined = _flatten_optim_state_dict(combined)
    return _maybe_full_or_cpu(combined, info)


def _split_optim_state_dict(optim: "torch.optim.Optimizer", osd: Dict[str, Any],
                            info: _StateDictInfo) -> Dict[str, Any]:
    """The part of an FQN-keyed optimizer state_dict that belongs to ``optim``, in its order."""
    if all(isinstance(k, int) for k in osd[_STATE]):
        return osd
    state: Dict[str, Any] = {}
    groups: List[Dict[str, Any]] = []
    group_of: Dict[int, int] = {}
    for group in optim.param_groups:
        groups.append({_PARAMS: []})
        for param in group[_PARAMS]:
            for fqn in info.fqns_of_param[param]:
                if fqn in info.shared_fqns and not any(fqn in g[_PARAMS] for g in osd[_PG]):
                    continue
                groups[-1][_PARAMS].append(fqn)
                if param.requires_grad:
                    if fqn in osd[_STATE]:
                        state[fqn] = osd[_STATE][fqn]
                    elif info.strict:
                        raise RuntimeError(
                            f"Missing optimizer state for parameter '{fqn}' in checkpoint. The parameter "
                            "requires gradients but has no saved optimizer state. To load anyway, use "
                            "StateDictOptions(strict=False).")
                for loaded in osd[_PG]:
                    if fqn in loaded[_PARAMS]:
                        group_of[id(loaded)] = len(groups) - 1
        if not group[_PARAMS]:
            empty = [g for g in osd[_PG] if not g[_PARAMS]]
            if len(empty) != 1:
                raise ValueError("There are param groups that have zero parameters. In such a case, DSD "
                                 "only support exactly one param group with zero parameters.But the "
                                 "loaded state_dict has zero or more than one param groups that have "
                                 "zero parameters.")
            if len(osd[_PG]) != len(optim.param_groups):
                raise ValueError("When there is a parameter group that has zero parameters, multiple "
                                 "optimizers are not supported.")
            group_of[id(empty[0])] = len(groups) - 1
    for loaded in osd[_PG]:
        index = group_of.get(id(loaded), -1)
        if index != -1:
            groups[index].update({k: v for k, v in loaded.items() if k != _PARAMS})
    return {_STATE: state, _PG: groups}


def _flat_items(obj: Any, path: Tuple[Any, ...] = ()) -> Iterator[Tuple[Tuple[Any, ...], Any]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _flat_items(value, path + (key,))
    elif isinstance(obj, list):
        for index, value in enumerate(obj):
            yield from _flat_items(value, path + (index,))
    else:
        yield path, obj


def _set_path(root: Any, path: Tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        root = root[key]
    root[path[-1]] = value


def _load_optim_state_dict(model: "nn.Module", optims: Tuple[Any, ...], osd: Dict[str, Any],
                           info: _StateDictInfo) -> None:
    if not info.handle_optim:
        return
    for optim in optims:
        _init_optim_state(optim)
        if osd:
            mine = _split_optim_state_dict(optim, osd, info) if _STATE in osd else \
                _unflatten_optim_state_dict(optim, osd, info)
        else:
            mine = {}
        if info.broadcast_from_rank0:
            local_info = replace(info, full_state_dict=False, cpu_offload=False, flatten_optimizer_state_dict=False)
            local = _get_optim_state_dict(model, (optim,), local_info)
            flat_local = {str(path): value for path, value in _flat_items(local)}
            paths = {str(path): path for path, _ in _flat_items(local)}
            _broadcast_from_rank0({str(p): v for p, v in _flat_items(mine)}, flat_local, strict=False)
            for key, value in flat_local.items():
                _set_path(local, paths[key], value)
            mine = local
        optim.load_state_dict(mine)


def _as_tuple(optimizers: Union["torch.optim.Optimizer", Iterable["torch.optim.Optimizer"]]) -> Tuple[Any, ...]:
    import torch

    return (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)


@_gc_free
def get_model_state_dict(model: "nn.Module", *, submodules: Optional[Set["nn.Module"]] = None,
                         options: Optional[StateDictOptions] = None) -> Dict[str, Any]:
    """The model's state_dict keyed by canonical FQNs (see ``get_state_dict``)."""
    info = _verify_options(model, (), optim_only=False, submodules=submodules, options=options)
    model_state_dict = _get_model_state_dict(model, info)
    _verify_state_dict(model_state_dict, {}, info)
    return model_state_dict


@_gc_free
def get_optimizer_state_dict(model: "nn.Module", optimizers: Any, *,
                             submodules: Optional[Set["nn.Module"]] = None,
                             options: Optional[StateDictOptions] = None) -> Dict[str, Any]:
    """The optimizers' combined state_dict, parameters named by canonical FQNs."""
    optims = _as_tuple(optimizers)
    info = _verify_options(model, optims, optim_only=True, submodules=submodules, options=options)
    optim_state_dict = _get_optim_state_dict(model, optims, info)
    _verify_state_dict({}, optim_state_dict, info)
    return optim_state_dict


@_gc_free
def get_state_dict(model: "nn.Module", optimizers: Any, *, submodules: Optional[Set["nn.Module"]] = None,
                   options: Optional[StateDictOptions] = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(model state_dict, optimizers state_dict)`` keyed by canonical FQNs: the same keys for
    a plain, a DDP and a compiled model, and optimizer state by parameter name, not index."""
    optims = _as_tuple(optimizers)
    info = _verify_options(model, optims, optim_only=False, submodules=submodules, options=options)
    model_state_dict = _get_model_state_dict(model, info)
    optim_state_dict = _get_optim_state_dict(model, optims, info)
    _verify_state_dict(model_state_dict, optim_state_dict, info)
    return model_state_dict, optim_state_dict


def _unflatten_model_state_dict(model: "nn.Module", state_dict: Dict[Any, Any]) -> Dict[str, Any]:
    """Accept the deprecated ``{submodule: its state_dict}`` form too."""
    from torch import nn

    if not state_dict or not isinstance(next(iter(state_dict)), nn.Module):
        return state_dict
    warnings.warn("Passing model_state_dict as a ``Dict[nn.Module, Dict[str, Any]]``is deprecated and "
                  "will be removed in 2.5. If you need this feature, please preprocess the "
                  "model_state_dict to achieve the same functionality.", FutureWarning, stacklevel=3)
    out: Dict[str, Any] = {}
    for submodule, sub_state_dict in state_dict.items():
        for name, module in model.named_modules():
            if module is submodule:
                prefix = f"{_get_fqn(model, name)}."
                out.update({prefix + key: value for key, value in sub_state_dict.items()})
    return out


@_gc_free
def set_model_state_dict(model: "nn.Module", model_state_dict: Dict[str, Any], *,
                         options: Optional[StateDictOptions] = None) -> Any:
    """Load a state_dict keyed by canonical FQNs; returns ``missing_keys``/``unexpected_keys``."""
    model_state_dict = _unflatten_model_state_dict(model, model_state_dict)
    info = _verify_options(model, (), optim_only=False, options=options)
    _verify_state_dict(model_state_dict, {}, info)
    return _load_model_state_dict(model, model_state_dict, info)


@_gc_free
def set_optimizer_state_dict(model: "nn.Module", optimizers: Any, optim_state_dict: Dict[str, Any], *,
                             options: Optional[StateDictOptions] = None) -> None:
    """Load an optimizer state_dict made by ``get_optimizer_state_dict`` (plain or flattened)."""
    optims = _as_tuple(optimizers)
    info = _verify_options(model, optims, optim_only=True, options=options)
    _verify_state_dict({}, optim_state_dict, info)
    _load_optim_state_dict(model, optims, optim_state_dict, info)


@_gc_free
def set_state_dict(model: "nn.Module", optimizers: Any, *, model_state_dict: Dict[str, Any],
                   optim_state_dict: Dict[str, Any], options: Optional[StateDictOptions] = None) -> Any:
    """Load the model and optimizers state_dicts; returns the model's incompatible keys."""
    model_state_dict = _unflatten_model_state_dict(model, model_state_dict)
    optims = _as_tuple(optimizers)
    info = _verify_options(model, optims, optim_only=not model_state_dict, options=options)
    _verify_state_dict(model_state_dict, optim_state_dict, info)
    _load_optim_state_dict(model, optims, optim_state_dict, info)
    return _load_model_state_dict(model, model_state_dict, info)


STATE_DICT_API = (StateDictOptions, get_model_state_dict, get_optimizer_state_dict, get_state_dict,
                  set_model_state_dict, set_optimizer_state_dict, set_state_dict)


PATCH.sets("torch.distributed.checkpoint.state_dict", [obj.__name__ for obj in STATE_DICT_API])


@PATCH.module("torch.distributed.checkpoint.state_dict")
def build_state_dict(module: ModuleType) -> None:
    for obj in STATE_DICT_API:
        setattr(module, obj.__name__, obj)
    module.__all__ = [obj.__name__ for obj in STATE_DICT_API]


# -- dcp.save / dcp.load --------------------------------------------------------------------------
def _storage_setup(storage: Any, checkpoint_id: Union[str, "os.PathLike[str]", None], reader: bool) -> Any:
    """The given storage (pointed at ``checkpoint_id``), or a file-system one for ``checkpoint_id``."""
    import torch.distributed.checkpoint as dcp

    if storage:
        if checkpoint_id is not None:
            if not hasattr(storage, "reset"):
                raise ValueError(f"{type(storage).__name__} of this torch cannot be pointed at a checkpoint_id "
                                 "(it has no reset()); pass either checkpoint_id or a storage made for it")
            storage.reset(checkpoint_id)
        return storage
    if not checkpoint_id:
        raise RuntimeError("`checkpoint_id` must be specificed if storage_reader/storage_writer is None.")
    if "://" not in str(checkpoint_id):
        return dcp.FileSystemReader(checkpoint_id) if reader else dcp.FileSystemWriter(checkpoint_id)
    try:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    except ImportError as exc:
        raise RuntimeError("Cannot detect which StorageReader or StorageWriter to use. Please specify the "
                           "storage_reader/storage_writer.") from exc
    return FsspecReader(checkpoint_id) if reader else FsspecWriter(checkpoint_id)


def _no_dist(what: str) -> bool:
    if _is_distributed():
        return False
    warnings.warn(f"torch.distributed is disabled, unavailable or uninitialized, assuming the intent is "
                  f"to {what} in a single process.", stacklevel=3)
    return True


def save(state_dict: Dict[str, Any], *, checkpoint_id: Union[str, "os.PathLike[str]", None] = None,
         storage_writer: Any = None, planner: Any = None, process_group: Any = None) -> Any:
    """Save a distributed state_dict in SPMD style; ``Stateful`` values are saved through their
    ``state_dict()``. Returns the checkpoint's Metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.stateful import Stateful as StatefulProtocol

    no_dist = _no_dist("save")
    writer = _storage_setup(storage_writer, checkpoint_id, reader=False)
    flat = {key: value.state_dict() if isinstance(value, StatefulProtocol) else value
            for key, value in state_dict.items()}
    return dcp.save_state_dict(flat, storage_writer=writer, process_group=process_group,
                               no_dist=no_dist, planner=planner)


def load(state_dict: Dict[str, Any], *, checkpoint_id: Union[str, "os.PathLike[str]", None] = None,
         storage_reader: Any = None, planner: Any = None, process_group: Any = None) -> None:
    """Load a checkpoint into ``state_dict`` in place; ``Stateful`` values get
    ``load_state_dict()`` with what was read into their ``state_dict()``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.stateful import Stateful as StatefulProtocol

    no_dist = _no_dist("load")
    reader = _storage_setup(storage_reader, checkpoint_id, reader=True)
    keys = sorted(state_dict.keys())
    loaded = {key: state_dict[key].state_dict() if isinstance(state_dict[key], StatefulProtocol) else state_dict[key]
              for key in keys}
    dcp.load_state_dict(loaded, storage_reader=reader, process_group=process_group, no_dist=no_dist,
                        planner=planner)
    for key in keys:
        if isinstance(state_dict[key], StatefulProtocol):
            state_dict[key].load_state_dict(loaded[key])
        else:
            state_dict[key] = loaded[key]


@PATCH.on_import("torch.distributed.checkpoint")
def serve_save_and_load(patcher: Patcher, dcp: ModuleType) -> bool:
    """``save``/``load`` on the package and its saver/loader modules, where the planners flatten
    nested state dicts (1.13's do not: no ``save``/``load`` there)."""
    planner = getattr(dcp, "DefaultSavePlanner", None)  # 1.13 does not even export it
    if hasattr(dcp, "save") and hasattr(dcp, "load"):
        return False
    if planner is None or "flatten_state_dict" not in inspect.signature(planner.__init__).parameters:
        return False
    import torch.distributed.checkpoint.state_dict_loader as loader
    import torch.distributed.checkpoint.state_dict_saver as saver

    for owner, name, fn in ((dcp, "save", save), (saver, "save", save), (dcp, "load", load), (loader, "load", load)):
        if not hasattr(owner, name):
            patcher.setattr(owner, name, fn)
    return True
