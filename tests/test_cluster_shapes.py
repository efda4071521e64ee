"""Cluster shapes without torchtitan: 3-D device meshes, FSDP2 + TP on their submeshes, DCP, on 8 gloo ranks.

One 8-rank job per torch (tests/cluster_shapes_program.py) does every part: (a) the 3-D meshes
("dp_replicate", "dp_shard", "tp") and ("pp", "dp", "tp"), their submeshes, ``_flatten`` (served on 2.4 by
device-mesh-flatten) and ``_unflatten`` (served on 2.4-2.9 by device-mesh-unflatten), each group's ranks held to
the row-major layout and proved by an all-reduce; (b, c) HSDP + TP (shape A) and two pipeline stages with
FSDP2 + TP each (shape B), every gradient and updated weight equal bit for bit to one process's on the global
batch (exact by construction: the program's docstring derives it); (d) a DCP save and load of a DTensor
placed (Replicate, Shard(0), Shard(1)) on the 3-D mesh.

With ``TORCHPATCH=1`` on torch 2.4, 2.9 and 2.13 (2.14 lies between 2.13 and 2.15, both run: its session
skips this job, CI's budget), natively on 2.15 (its own API the oracle: the same assertions). HSDP + TP,
which 2.4.1's FSDP2 refuses (``NotImplementedError: Using TP with HSDP is not supported``), is served there
by fsdp2-hsdp-tp. ``_unflatten`` (torch 2.10) is served on 2.4 too since issue 42 (torchtitan 0.2.2 and
0.3.0 build their meshes with it); before, the job asserted 2.4's ``AttributeError: 'DeviceMesh' object has
no attribute '_unflatten'``.

The comparison sees silent faults: on 2.4 with fsdp2-2d-state-dict switched off
(``TORCHPATCH_FSDP2_2D_STATE_DICT=0``) the colwise stage's gradients and weights come out of
``full_tensor()`` with TP's and FSDP's rows interleaved wrongly (largest difference 9.8), and the job fails.
"""

import itertools
from typing import Dict, List, Sequence, Tuple

import pytest

from cluster_shapes_program import PROGRAM
from conftest import RESULT, clean_env, only_torch, ranks_result, torch_matches

pytestmark = only_torch(">=2.4,!=2.14.*", "torch 2.4 (the first FSDP2) on; 2.14 is covered by 2.13 and 2.15")

SHAPE = (2, 2, 2)
WORLD = 8
NAMES_A = ("dp_replicate", "dp_shard", "tp")
NAMES_B = ("pp", "dp", "tp")


def coordinate(rank: int) -> Tuple[int, ...]:
    """The rank's coordinate on the row-major 2 x 2 x 2 mesh."""
    return (rank // 4, rank // 2 % 2, rank % 2)


def group(rank: int, dims: Sequence[int]) -> List[int]:
    """The ranks that differ from ``rank`` only along root ``dims`` (in row-major order over them)."""
    mine = coordinate(rank)
    return sorted(r for r in range(WORLD) if all(c == m for d, (c, m) in enumerate(zip(coordinate(r), mine))
                                                 if d not in dims))


def expected(rank: int, spans: Sequence[Sequence[int]], names: Sequence[str]) -> Dict:
    """What ``describe`` reports for the submesh of this rank whose dims stand for root dims ``spans``."""
    dims = [d for span in spans for d in span]
    ranks = group(rank, dims)  # row-major over the submesh's dims (they are in root order)
    sizes = [2 ** len(span) for span in spans]
    tensor = ranks
    for size in reversed(sizes[1:]):
        tensor = [tensor[i:i + size] for i in range(0, len(tensor), size)]
    groups = [group(rank, span) for span in spans]
    return {"mesh": tensor, "names": list(names), "dims": [{"ranks": g, "sum": sum(g)} for g in groups]}


MESHES = {  # name -> (root dims each submesh dim stands for, its names)
    "A": ([[0], [1], [2]], NAMES_A),
    "A[dp_replicate,dp_shard]": ([[0], [1]], ("dp_replicate", "dp_shard")),
    "A[tp]": ([[2]], ("tp",)),
    "A[dp_replicate,dp_shard]._flatten(dp)": ([[0, 1]], ("dp",)),
    "A[dp]": ([[0, 1]], ("dp",)),
    "A[dp,tp]": ([[0, 1], [2]], ("dp", "tp")),
    "B": ([[0], [1], [2]], NAMES_B),
    "B[dp,tp]": ([[1], [2]], ("dp", "tp")),
    "B[pp]": ([[0]], ("pp",)),
    "B[dp,tp]._flatten()": ([[1, 2]], ("dp_tp",)),
    "B[dp_tp]": ([[1, 2]], ("dp_tp",)),
}
UNFLATTENED = {"U": MESHES["B"], "U[dp,tp]": MESHES["B[dp,tp]"], "U[pp]": MESHES["B[pp]"],
               "U[dp,tp]._flatten()": MESHES["B[dp,tp]._flatten()"]}
PARAMS = ["lin1.weight", "lin1.bias", "lin2.weight", "lin2.bias"]


def test_cluster_shapes(tmp_path) -> None:
    env = clean_env() if torch_matches(">=2.15") else clean_env(TORCHPATCH="1")
    script = PROGRAM.replace("CKPT_AND_RESULT", repr((str(tmp_path / "ckpt"), RESULT)))
    ranks = ranks_result(script, nproc=WORLD, env=env, tmp_path=tmp_path, timeout=300)
    assert len(ranks) == WORLD

    for rank, out in enumerate(ranks):
        for name, (spans, names) in MESHES.items():
            assert out["meshes"][name] == expected(rank, spans, names), (rank, name)
        assert out["unflatten"] == {name: expected(rank, *UNFLATTENED[name]) for name in UNFLATTENED}, rank

        assert out["shape_a"].get("grads") == dict.fromkeys(PARAMS, True), (rank, out["shape_a"])
        assert out["shape_a"]["weights"] == dict.fromkeys(PARAMS, True), (rank, out["shape_a"])
        stage = PARAMS[:2] if rank < 4 else PARAMS[2:]
        assert out["shape_b"].get("grads") == dict.fromkeys(stage, True), (rank, out["shape_b"])
        assert out["shape_b"]["weights"] == dict.fromkeys(stage, True), (rank, out["shape_b"])

        assert len(out["dcp"]) == 2
        for placements, loaded in out["dcp"].items():
            assert loaded == {"placements": True, "equal": True}, (rank, placements)


@pytest.mark.torch_independent
def test_layout_helper() -> None:
    """The expected layout itself: rank 5 = (1, 0, 1) on the 2 x 2 x 2 mesh."""
    assert coordinate(5) == (1, 0, 1)
    assert expected(5, [[1], [2]], ("dp", "tp"))["mesh"] == [[4, 5], [6, 7]]
    assert expected(5, [[0, 1]], ("dp",))["dims"] == [{"ranks": [1, 3, 5, 7], "sum": 16}]
    assert list(itertools.chain.from_iterable(expected(0, [[0], [1], [2]], NAMES_A)["mesh"][1])) == [4, 5, 6, 7]
