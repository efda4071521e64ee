"""vmap-saved-tensor-hooks: ``torch.vmap`` inside saved-tensor hooks (a non-reentrant checkpoint's
forward, ``save_on_cpu``) on torch 2.4.

What breaks:   torch 2.4's ``vmap`` refuses to run while saved-tensor hooks are set, as ``grad`` and
               ``vjp`` do: anything vmapped inside an activation-checkpointed block dies with
               ``RuntimeError: torch.func transforms don't yet support saved tensor hooks. Please open
               an issue with your use case.`` (torchtitan 0.3.0's ``fsdp+tp+sac``: FlexAttention's
               ``create_mask`` vmaps the mask_mod inside each checkpointed block).
Torch:         2.4 (``_flat_vmap`` and ``restore_vmap`` carry ``doesnt_support_saved_tensors_hooks``);
               torch 2.5 keeps the refusal for ``grad``/``vjp`` only.
Fix:           as torch 2.5: ``vmap`` runs without the refusal. vmap works above autograd, so what
               autograd saves (and the hooks see) inside it are ordinary tensors; ``grad``, ``vjp``
               and the transforms nested in them still refuse.
Upstream:      https://github.com/pytorch/pytorch/pull/131191
"""

from types import ModuleType

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="vmap-saved-tensor-hooks",
    summary="torch.vmap inside saved-tensor hooks (a non-reentrant checkpoint's forward, save_on_cpu)",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/131191",
    behaviour="torch.vmap(f)(x) under saved_tensors_hooks / checkpoint(use_reentrant=False)",
    errors=(
        Error(r"torch\.func transforms don't yet support saved tensor hooks",
              "RuntimeError: torch.func transforms don't yet support saved tensor hooks. Please open an issue "
              "with your use case."),
    ),
)

_REFUSING = ("_flat_vmap", "restore_vmap")  # vmap's entry points wrapped in the refusal on torch 2.4


@PATCH.on_import("torch._functorch.vmap")
def vmap_under_hooks(patcher: Patcher, vmap: ModuleType) -> bool:
    refusal = getattr(vmap, "doesnt_support_saved_tensors_hooks", None)
    wrapped = [name for name in _REFUSING
               if refusal is not None and getattr(getattr(vmap, name, None), "__wrapped__", None) is not None]
    for name in wrapped:
        patcher.setattr(vmap, name, getattr(vmap, name).__wrapped__)
    return bool(wrapped)
