"""xla-parallelize: ``parallelize_module`` on an XLA device mesh shards parameters with torch_xla
SPMD, torch 2.4 and later.

What breaks:   pytorch/xla users who apply tensor parallelism the standard way,
               ``parallelize_module(model, init_device_mesh("xla", (n,)), {"in_proj": ColwiseParallel(),
               "out_proj": RowwiseParallel()})``, get a model whose first forward pass dies in the style's
               input hook: on torch/torch_xla 2.9 with ``AttributeError: 'DeviceMesh' object has no
               attribute '_coordinate_on_dim'`` (``DTensor.from_local`` asks an XLA mesh, which has no
               process groups, for this rank's coordinate); older releases hit
               ``!at::functionalization::impl::isFunctionalTensor(t) INTERNAL ASSERT FAILED``. Its
               parameters are ``nn.Parameter``s around ``XLAShardedTensor``s, which
               ``torch_xla._XLAC._get_xla_sharding_spec`` rejects (``Expected XLA tensor``).
Torch:         every torch with torch_xla SPMD (checked on 2.9 + torch_xla 2.9; the styles read here
               have the same attributes from 2.4 on). Meshes of other device types are untouched.
Fix:           ``parallelize_module`` (in ``torch.distributed.tensor.parallel`` and its ``api``/``_api``
               module, wherever torch binds it) is wrapped; for a mesh whose ``device_type`` is ``xla``
               the plan becomes one ``distribute_tensor`` call per parameter, the maintainers' recipe:
               torch_xla annotates the parameter itself (``mark_sharding``) and the module keeps plain
               XLA parameters, so the model stays a single-device program that SPMD partitions, and
               forward, backward and optimizers compute what the unsharded model computes.
               - ColwiseParallel: Linear weight and bias ``Shard(0)``; Embedding weight ``Shard(1)``.
               - RowwiseParallel: Linear weight ``Shard(1)``, bias ``Replicate()``; Embedding weight
                 ``Shard(0)``. Other module types raise ``NotImplementedError`` as torch does.
               - SequenceParallel: parameters ``Replicate()``, the first input annotated sharded on
                 the sequence dimension.
               - PrepareModuleInput / PrepareModuleOutput / PrepareModuleInputOutput: the inputs and
                 outputs that have a layout are annotated with the layout torch redistributes them to.
               - ColwiseParallel/RowwiseParallel with ``input_layouts`` set to one that torch
                 redistributes (``ColwiseParallel(input_layouts=Shard(1))``), or with ``output_layouts``
                 other than their default: that activation is annotated with the layout torch makes.
               Annotations use ``torch_xla.distributed.spmd.mark_sharding_with_gradients`` (the
               gradient gets the same sharding). No other hook is installed: the default Colwise /
               Rowwise plan is parameter sharding only. Where torch_xla lacks that function, or a
               layout is ``Partial``, a warning names the module, the style and the layout left to
               XLA's sharding propagation (the values are unaffected). A style this patch does not
               know (a custom ``ParallelStyle``) is not applied: a warning names it and the module;
               its parameters stay replicated. Subclasses of Colwise/Rowwise get their base class's
               parameter sharding and a warning that their own ``_apply`` is not run. Plans: one
               style, or a dict with nested and ``fnmatch`` wildcard keys (``"layers.*.attn.wq"``,
               ``""`` for the module itself), as torch resolves them; ``src_data_rank`` is accepted
               and has no meaning under SPMD (one controller holds the global tensors). The mesh
               must be 1-D. Parameters not yet on an XLA device are moved there (new Parameter
               objects, as torch's styles make), so move the model to ``xla`` first.
               Modules see global shapes under SPMD (a Colwise output is not a local shard), and
               outputs are plain XLA tensors, never DTensors.
Upstream:      https://github.com/pytorch/xla/issues/8534
"""

from __future__ import annotations

import warnings
from fnmatch import fnmatch
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="xla-parallelize",
    summary="parallelize_module on an xla DeviceMesh: the plan becomes per-parameter distribute_tensor "
    "calls (torch_xla SPMD) instead of DTensor hooks that fail",
    torch=">=2.4",
    upstream="https://github.com/pytorch/xla/issues/8534",
    behaviour="parallelize_module with an xla device mesh shards parameters with distribute_tensor",
)

PACKAGE = "torch.distributed.tensor.parallel"
API_MODULES = ("api", "_api")


def _plan_args(module: Any, device_mesh: Any = None, parallelize_plan: Any = None,
               *_args: Any, **_kwargs: Any) -> Tuple[Any, Any, Any]:
    return module, device_mesh, parallelize_plan


def _xla_mesh(device_mesh: Any) -> Any:
    """The mesh ``parallelize_module`` would use, if its device type is ``xla``; else None."""
    if device_mesh is None:
        try:  # torch's fallback: the mesh of an enclosing ``with mesh:`` block
            from torch.distributed.device_mesh import _mesh_resources

            device_mesh = _mesh_resources.get_current_mesh()
        except Exception:
            return None
    return device_mesh if getattr(device_mesh, "device_type", None) == "xla" else None


def _parallelize_module(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                        kwargs: Dict[str, Any]) -> Any:
    """wrapt wrapper of ``parallelize_module``: XLA meshes go to :func:`parallelize_on_xla`."""
    try:
        module, device_mesh, plan = _plan_args(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)
    mesh = _xla_mesh(device_mesh)
    if mesh is None:
        return wrapped(*args, **kwargs)
    return parallelize_on_xla(module, mesh, plan)


@PATCH.on_import(PACKAGE)
def reroute_parallelize_module(patcher: Patcher, package: ModuleType) -> bool:
    import importlib

    owners: List[ModuleType] = [package]
    for name in API_MODULES:
        try:
            owners.append(importlib.import_module(f"{PACKAGE}.{name}"))
        except ImportError:
            continue
    owners = [m for m in owners if callable(vars(m).get("parallelize_module"))]
    for owner in owners:
        patcher.wrap(owner, "parallelize_module", _parallelize_module)
    return bool(owners)


# -- the translation -----------------------------------------------------------------------------

def _dtensor_api() -> Tuple[Callable[..., Any], type, type, type]:
    """(distribute_tensor, Shard, Replicate, Partial) of this torch."""
    try:
        from torch.distributed.tensor import distribute_tensor
        from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
    except ImportError:  # torch 2.4 (without the dtensor-public patch)
        from torch.distributed._tensor import distribute_tensor
        from torch.distributed._tensor.placement_types import Partial, Replicate, Shard
    return distribute_tensor, Shard, Replicate, Partial


def _describe(name: str, module: Any) -> str:
    return f"module '{name}' ({type(module).__name__})" if name else f"the root module ({type(module).__name__})"


def _resolve(module: Any, path: str, prefix: str = "") -> List[Tuple[str, Any]]:
    """The submodules a plan key names, each with its qualified name; tokens match children
    with ``fnmatch`` level by level, as torch's ``parallelize_module`` does."""
    if path == "":
        return [(prefix, module)]
    token, _, rest = path.partition(".")
    found: List[Tuple[str, Any]] = []
    for child_name, child in module.named_children():
        if fnmatch(child_name, token):
            qualified = f"{prefix}.{child_name}" if prefix else child_name
            found += _resolve(child, rest, qualified) if rest else [(qualified, child)]
    return found


class _Translator:
    """Applies one plan on a 1-D xla ``DeviceMesh``: parameters through ``distribute_tensor``,
    activation layouts through torch_xla's ``mark_sharding_with_gradients``."""

    def __init__(self, mesh: Any) -> None:
        import torch.distributed.tensor.parallel.style as style

        if mesh.ndim != 1:
            raise ValueError(f"parallelize_module on an xla DeviceMesh (torchpatch xla-parallelize) needs a 1-D "
                             f"mesh over all devices; got {mesh.ndim} dimensions {tuple(mesh.mesh.shape)}")
        self.mesh = mesh
        self.style = style
        self.distribute_tensor, self.Shard, self.Replicate, self.Partial = _dtensor_api()
        self._mark: Optional[Callable[..., Any]] = None  # mark_sharding_with_gradients, once needed
        self._xla_mesh: Any = None

    # parameters
    def shard(self, module: Any, name: str, placement: Any) -> None:
        import torch.nn as nn

        param = getattr(module, name, None)
        if param is None:
            return
        if param.device.type != "xla":
            param = nn.Parameter(param.detach().to("xla"), requires_grad=param.requires_grad)
            module.register_parameter(name, param)
        # torch_xla's xla_distribute_tensor annotates this very tensor (mark_sharding); the
        # XLAShardedTensor it returns is a view of it that the module does not need.
        self.distribute_tensor(param, self.mesh, [placement])

    # activations
    def annotate(self, value: Any, placement: Any, where: str) -> Any:
        import torch

        if placement is None or not isinstance(value, torch.Tensor):
            return value
        spec: List[Optional[int]] = [None] * value.dim()
        if isinstance(placement, self.Shard):
            if not -value.dim() <= placement.dim < value.dim():
                raise ValueError(f"{where}: layout {placement!r} does not fit a tensor of shape {tuple(value.shape)}")
            spec[placement.dim % value.dim()] = 0
        return self._mark(value, self._xla_mesh, tuple(spec))

    def usable(self, layouts: Sequence[Any], what: str, where: str, style: Any) -> Optional[Tuple[Any, ...]]:
        """``layouts`` as they can be annotated (a ``Partial`` one as None, with a warning), or None
        where there is nothing to annotate or torch_xla cannot annotate activations (a warning)."""
        if all(p is None for p in layouts):
            return None
        name = type(style).__name__
        if self._mark is None:
            try:
                from torch_xla.distributed.spmd import mark_sharding_with_gradients
                from torch_xla.distributed.spmd.api import convert_to_xla_mesh
            except ImportError:
                warnings.warn(f"torchpatch xla-parallelize: {where}, {name}: the {what} layouts {tuple(layouts)} "
                              "are not applied (this torch_xla has no mark_sharding_with_gradients); XLA's "
                              "sharding propagation chooses them instead, the values are unaffected", stacklevel=5)
                return None
            self._mark, self._xla_mesh = mark_sharding_with_gradients, convert_to_xla_mesh(self.mesh)
        for p in layouts:
            if isinstance(p, self.Partial):
                warnings.warn(f"torchpatch xla-parallelize: {where}, {name}: the {what} layout {p!r} has no XLA "
                              "sharding annotation and is not applied; XLA's sharding propagation chooses it "
                              "instead, the values are unaffected", stacklevel=5)
        layouts = tuple(None if isinstance(p, self.Partial) else p for p in layouts)
        return None if all(p is None for p in layouts) else layouts

    def hook_inputs(self, module: Any, where: str, layouts: Sequence[Any],
                    kwarg_layouts: Optional[Dict[str, Any]] = None) -> None:
        kwarg_layouts = kwarg_layouts or {}

        def annotate_inputs(_mod: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
            args = tuple(self.annotate(value, layout, f"{where} input {i}")
                         for i, (value, layout) in enumerate(zip(args, layouts))) + args[len(layouts):]
            kwargs = {key: self.annotate(value, kwarg_layouts.get(key), f"{where} input {key!r}")
                      for key, value in kwargs.items()}
            return args, kwargs

        module.register_forward_pre_hook(annotate_inputs, with_kwargs=True)

    def hook_outputs(self, module: Any, where: str, layouts: Sequence[Any]) -> None:
        def annotate_outputs(_mod: Any, _args: Any, outputs: Any) -> Any:
            if isinstance(outputs, tuple):
                return tuple(self.annotate(value, layout, f"{where} output {i}")
                             for i, (value, layout) in enumerate(zip(outputs, layouts))) + outputs[len(layouts):]
            return self.annotate(outputs, layouts[0], f"{where} output")

        module.register_forward_hook(annotate_outputs)

    # styles
    def apply(self, module: Any, name: str, plan_style: Any) -> None:
        import torch.nn as nn

        st = self.style
        where = _describe(name, module)
        kind = type(plan_style).__name__
        if isinstance(plan_style, (st.ColwiseParallel, st.RowwiseParallel)):
            colwise = isinstance(plan_style, st.ColwiseParallel)
            if type(plan_style) not in (st.ColwiseParallel, st.RowwiseParallel):
                warnings.warn(f"torchpatch xla-parallelize: {where}: {kind} is applied as its base class "
                              f"{'ColwiseParallel' if colwise else 'RowwiseParallel'} (parameter sharding); "
                              f"{kind}'s own _apply and hooks are not run on an xla mesh", stacklevel=3)
            if isinstance(module, nn.Linear):
                self.shard(module, "weight", self.Shard(0 if colwise else 1))
                self.shard(module, "bias", self.Shard(0) if colwise else self.Replicate())
            elif isinstance(module, nn.Embedding):
                self.shard(module, "weight", self.Shard(1 if colwise else 0))
            else:
                raise NotImplementedError(f"{kind} currently only support nn.Linear and nn.Embedding! "
                                          f"(got {where})")
            # Where a layout set in the plan makes torch redistribute an activation, annotate the
            # layout it redistributes to. The style's default input layout is the global input here
            # (on an Embedding, RowwiseParallel's default Shard(-1) takes each rank's ids for a slice).
            default_in = (self.Replicate(),) if colwise else (self.Shard(-1),)
            desired = (self.Replicate(),) if colwise or isinstance(module, nn.Embedding) else (self.Shard(-1),)
            natural = (self.Shard(-1),) if colwise else (self.Replicate(),)
            given = tuple(getattr(plan_style, "input_layouts", default_in))
            wanted_out = tuple(getattr(plan_style, "output_layouts", natural))
            if given not in (desired, default_in) and self.usable(desired, "input", where, plan_style):
                self.hook_inputs(module, where, desired)
            if wanted_out != natural:
                usable = self.usable(wanted_out, "output", where, plan_style)
                if usable:
                    self.hook_outputs(module, where, usable)
        elif isinstance(plan_style, st.SequenceParallel):
            for owner in list(module.modules()):
                for pname, _ in list(owner.named_parameters(recurse=False)):
                    self.shard(owner, pname, self.Replicate())
            sharding = getattr(plan_style, "sequence_sharding", None)
            if sharding is None:  # torch 2.4 keeps the dimension
                sharding = (self.Shard(plan_style.sequence_dim),)
            if self.usable(tuple(sharding), "input", where, plan_style):
                self.hook_inputs(module, where, tuple(sharding))
        elif hasattr(st, "PrepareModuleInputOutput") and isinstance(plan_style, st.PrepareModuleInputOutput):
            self.apply(module, name, plan_style.prepare_module_input)
            self.apply(module, name, plan_style.prepare_module_output)
        elif isinstance(plan_style, st.PrepareModuleInput):
            layouts = self._targets(plan_style.input_layouts, plan_style.desired_input_layouts)
            keys = list(plan_style.input_kwarg_layouts)
            kw_desired = plan_style.desired_input_kwarg_layouts
            kw_layouts = self._targets([plan_style.input_kwarg_layouts[k] for k in keys],
                                       [kw_desired.get(k) for k in keys])
            usable = self.usable(layouts + kw_layouts, "input", where, plan_style)
            if usable:
                self.hook_inputs(module, where, usable[:len(layouts)], dict(zip(keys, usable[len(layouts):])))
        elif isinstance(plan_style, st.PrepareModuleOutput):
            layouts = self._targets(plan_style.output_layouts, plan_style.desired_output_layouts)
            usable = self.usable(layouts, "output", where, plan_style)
            if usable:
                self.hook_outputs(module, where, usable)
        else:
            warnings.warn(f"torchpatch xla-parallelize: {where}: {kind} is not applied on an xla mesh (torchpatch "
                          "translates ColwiseParallel, RowwiseParallel, SequenceParallel and PrepareModuleInput/"
                          "Output into torch_xla sharding; a custom style's hooks would need DTensor's "
                          "process groups); its parameters stay replicated", stacklevel=3)

    @staticmethod
    def _targets(given: Optional[Sequence[Any]], desired: Optional[Sequence[Any]]) -> Tuple[Any, ...]:
        """Per position, the layout torch hands the module: none where no layout is given (the value
        is left alone), else the desired one, else the given one."""
        given = tuple(given or ())
        desired = tuple(desired or (None,) * len(given))
        return tuple(None if g is None else (g if d is None else d) for g, d in zip(given, desired))


def parallelize_on_xla(module: Any, device_mesh: Any, parallelize_plan: Any) -> Any:
    """``parallelize_module(module, device_mesh, parallelize_plan)`` for an xla ``device_mesh``:
    every parameter the plan names gets one ``distribute_tensor`` call; returns ``module``."""
    if parallelize_plan is None:
        warnings.warn("No parallelize_plan is provided and auto-parallel is not supported "
                      "at the moment, so this parallelize_module call will do nothing.", stacklevel=3)
        return module
    translator = _Translator(device_mesh)
    if isinstance(parallelize_plan, translator.style.ParallelStyle):
        translator.apply(module, "", parallelize_plan)
        return module
    if not isinstance(parallelize_plan, dict):
        raise TypeError("Expect Union[ParallelStyle, Dict[str, ParallelStyle]] for"
                        f" parallelize_plan, {type(parallelize_plan)} found!")
    for path, plan_style in parallelize_plan.items():
        targets = _resolve(module, path)
        if not targets:
            warnings.warn(f"Parallelize plan key '{path}' could not be resolved: no submodule matches it in "
                          f"{type(module).__name__}, skipping this plan entry.", stacklevel=3)
        for name, target in targets:
            translator.apply(target, name, plan_style)
    return module
