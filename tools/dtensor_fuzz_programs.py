"""The random DTensor programs of ``tools/dtensor_fuzz.py``: how one is drawn, and how one runs.

A program is a JSON-able dict drawn from ``(seed, index)`` with Python's own ``random`` (the same
program on every torch and every machine). It runs twice in each rank of a 2-rank gloo job: on
DTensors (the program under test) and on the full tensors in one process (the reference). Kinds:

- ``ops``: a chain of 1-3 ops on a DTensor (pointwise with numbers, reductions and norms, binary
  ops with a second DTensor, in-place and foreach forms), inputs of 1-2 dims (uneven and size-1
  dims), placements Shard/Replicate/Partial(sum, avg, max, min) on a 1-D mesh (2) or a 2-D mesh
  with a size-1 dim (2x1, 1x2: a degenerate tp=1 or dp=1 dimension);
- ``optim``: two AdamW or SGD steps (foreach or not) of a DTensor parameter;
- ``clip``: ``clip_grad_norm_`` of DTensor gradients (Partial ones included), 2-norm, 1-norm, inf;
- ``tp_mlp``: a ColwiseParallel + RowwiseParallel MLP, forward, backward and an optimizer step;
- ``norm_layer``: LayerNorm / RMSNorm under SequenceParallel, forward and backward;
- ``loss_parallel``: cross-entropy of vocabulary-sharded logits under ``loss_parallel()``, backward.

Values are float64, so a right result equals the reference within 1e-9 whatever order a CPU reduces in.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable, Dict, List, Sequence, Tuple

GENERATOR = 1  # bump when a seed's programs change: recorded in the corpus
SCALARS = (-2.0, -0.5, 0.5, 2.0, 3.0)
KINDS = (("ops", 70), ("optim", 8), ("clip", 8), ("tp_mlp", 6), ("norm_layer", 4), ("loss_parallel", 4))
# op -> (arity: 1 or 2, takes a number, takes a dim, reduces dims, integer result)
OPS: Dict[str, Tuple[int, bool, bool, bool]] = {
    "neg": (1, False, False, False), "abs": (1, False, False, False), "exp": (1, False, False, False),
    "relu": (1, False, False, False), "tanh": (1, False, False, False),
    "mul_s": (1, True, False, False), "div_s": (1, True, False, False), "add_s": (1, True, False, False),
    "sub_s": (1, True, False, False), "rsub_s": (1, True, False, False), "clamp_min": (1, True, False, False),
    "sum": (1, False, False, True), "sum_d": (1, False, True, True), "mean": (1, False, False, True),
    "mean_d": (1, False, True, True), "amax": (1, False, False, True), "amax_d": (1, False, True, True),
    "amin_d": (1, False, True, True), "max": (1, False, False, True), "max_d": (1, False, True, True),
    "argmax_d": (1, False, True, True), "norm": (1, False, False, True), "norm1": (1, False, False, True),
    "norm_inf": (1, False, False, True), "norm_d": (1, False, True, True),
    "add_s_": (1, True, False, False), "sub_s_": (1, True, False, False), "mul_s_": (1, True, False, False),
    "div_s_": (1, True, False, False), "neg_": (1, False, False, False), "exp_": (1, False, False, False),
    "relu_": (1, False, False, False), "clamp_min_": (1, True, False, False),
    "fe_mul_s_": (1, True, False, False), "fe_add_s_": (1, True, False, False),
    "fe_mul_t_": (1, True, False, False), "fe_norm": (1, False, False, True),
    "add": (2, False, False, False), "sub": (2, False, False, False), "mul": (2, False, False, False),
    "div": (2, False, False, False), "maximum": (2, False, False, False), "add_": (2, False, False, False),
    "sub_": (2, True, False, False), "mul_": (2, False, False, False), "copy_": (2, False, False, False),
    "fe_add_": (2, False, False, False),
}
PARTIALS = ("sum", "avg", "max", "min")


# -- drawing a program (pure Python) -------------------------------------------------------------
def draw(seed: int, index: int) -> Dict[str, Any]:
    """Program ``index`` of ``seed``: the same dict on every machine and Python 3."""
    rng = random.Random(f"dtensor-fuzz:{seed}:{index}")
    kind = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS])[0]
    program: Dict[str, Any] = {"kind": kind, "values": rng.randrange(2**31)}
    if kind == "ops":
        program["mesh"] = rng.choice([[2], [2], [2], [2, 1], [1, 2]])
        shape = [rng.choice([1, 2, 3, 4, 5]) for _ in range(rng.choice([1, 2]))]
        program["shape"] = shape
        program["inputs"] = [_placements(rng, program["mesh"], len(shape), partial=True) for _ in range(2)]
        program["ops"] = _chain(rng, len(shape))
    elif kind == "optim":
        program["mesh"] = [2]
        program["shape"] = [rng.choice([1, 2, 3, 4, 5]) for _ in range(rng.choice([1, 2]))]
        program["param"] = _placements(rng, [2], len(program["shape"]), partial=False)
        program["grad"] = _placements(rng, [2], len(program["shape"]), partial=rng.random() < 0.2)
        program["optimizer"] = rng.choice(["AdamW", "SGD"])
        program["foreach"] = rng.choice([True, False])
    elif kind == "clip":
        program["mesh"] = rng.choice([[2], [2, 1]])
        program["shapes"] = [[rng.choice([1, 2, 3, 4, 5]) for _ in range(rng.choice([1, 2]))]
                             for _ in range(rng.choice([1, 2, 3]))]
        program["grads"] = [_placements(rng, program["mesh"], len(s), partial=True, kinds=("sum",))
                            for s in program["shapes"]]
        program["norm_type"] = rng.choice([2.0, 2.0, 1.0, "inf"])
        program["max_norm_ratio"] = rng.choice([0.5, 2.0])
        program["foreach"] = rng.choice([True, False, None])
    elif kind == "tp_mlp":
        program["mesh"] = [2]
        program["dims"] = [rng.choice([2, 3, 4]), rng.choice([2, 3, 4, 6]), rng.choice([1, 2, 3])]
        program["bias"] = rng.choice([True, False])
        program["optimizer"] = rng.choice(["AdamW", "SGD"])
        program["foreach"] = rng.choice([True, False])
    elif kind == "norm_layer":
        program["mesh"] = [2]
        program["layer"] = rng.choice(["LayerNorm", "RMSNorm"])
        program["dims"] = [rng.choice([1, 2]), rng.choice([2, 3, 4]), rng.choice([2, 3, 4])]
    else:
        program["mesh"] = [2]
        program["dims"] = [rng.choice([1, 2, 3]), rng.choice([2, 3, 4, 5])]
    return program


def _placements(rng: random.Random, mesh: Sequence[int], ndim: int, partial: bool,
                kinds: Sequence[str] = PARTIALS) -> List[List[Any]]:
    """One placement per mesh dim; a tensor's Partials are all of one kind (torch 2.11+ refuses mixed
    kinds when a DTensor is made: such a program would test nothing but that refusal)."""
    choices: List[List[Any]] = [["R"]] + [["S", d] for d in range(ndim)]
    if partial:
        choices += [["P", rng.choice(kinds)]]
    return [rng.choice(choices) for _ in mesh]


def _chain(rng: random.Random, ndim: int) -> List[List[Any]]:
    ops: List[List[Any]] = []
    same_shape = True
    for _ in range(rng.choice([1, 1, 2, 2, 3])):
        names = [n for n, (arity, _, dim, _) in OPS.items()
                 if (arity == 1 or same_shape) and (not dim or ndim > 0)]
        name = rng.choice(names)
        arity, number, dim, reduces = OPS[name]
        op: List[Any] = [name]
        if number:
            op.append(rng.choice(SCALARS))
        if dim:
            op.append(rng.randrange(ndim))
        ops.append(op)
        if reduces:
            ndim = ndim - 1 if dim else 0
            same_shape = False
        if name == "argmax_d":
            break
    return ops


# -- running a program (torch) -------------------------------------------------------------------
def apply_op(torch: Any, op: Sequence[Any], x: Any, y: Any, scalar_tensor: Callable[[float], Any]) -> Any:
    """``op`` on ``x`` (and ``y``): the same code for DTensors and for full tensors."""
    name, args = op[0], list(op[1:])
    a = args[0] if OPS[name][1] else None
    d = args[-1] if OPS[name][2] else None
    table: Dict[str, Callable[[], Any]] = {
        "neg": lambda: x.neg(), "abs": lambda: x.abs(), "exp": lambda: x.exp(), "relu": lambda: torch.relu(x),
        "tanh": lambda: x.tanh(), "mul_s": lambda: x * a, "div_s": lambda: x / a, "add_s": lambda: x + a,
        "sub_s": lambda: x - a, "rsub_s": lambda: a - x, "clamp_min": lambda: x.clamp(min=a),
        "sum": lambda: x.sum(), "sum_d": lambda: x.sum(d), "mean": lambda: x.mean(), "mean_d": lambda: x.mean(d),
        "amax": lambda: x.amax(), "amax_d": lambda: x.amax(d), "amin_d": lambda: x.amin(d), "max": lambda: x.max(),
        "max_d": lambda: x.max(d)[0], "argmax_d": lambda: x.argmax(d), "norm": lambda: x.norm(),
        "norm1": lambda: x.norm(p=1), "norm_inf": lambda: torch.linalg.vector_norm(x, ord=math.inf),
        "norm_d": lambda: x.norm(dim=d), "add_s_": lambda: x.add_(a), "sub_s_": lambda: x.sub_(a),
        "mul_s_": lambda: x.mul_(a), "div_s_": lambda: x.div_(a), "neg_": lambda: x.neg_(), "exp_": lambda: x.exp_(),
        "relu_": lambda: x.relu_(), "clamp_min_": lambda: x.clamp_min_(a),
        "fe_mul_s_": lambda: (torch._foreach_mul_([x], a), x)[1],
        "fe_add_s_": lambda: (torch._foreach_add_([x], a), x)[1],
        "fe_mul_t_": lambda: (torch._foreach_mul_([x], scalar_tensor(a)), x)[1],
        "fe_norm": lambda: torch._foreach_norm([x])[0],
        "add": lambda: x + y, "sub": lambda: x - y, "mul": lambda: x * y, "div": lambda: x / y,
        "maximum": lambda: torch.maximum(x, y), "add_": lambda: x.add_(y), "sub_": lambda: x.sub_(y, alpha=a),
        "mul_": lambda: x.mul_(y), "copy_": lambda: x.copy_(y), "fe_add_": lambda: (torch._foreach_add_([x], [y]), x)[1],
    }
    return table[name]()


def full_values(rng: random.Random, shape: Sequence[int], low: float = -3.0, high: float = 3.0) -> List[float]:
    n = 1
    for s in shape:
        n *= s
    return [round(rng.uniform(low, high), 3) for _ in range(n)]
