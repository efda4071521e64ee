"""fsdp2-unflattened-meshes: FSDP2 + TP with the DP and TP meshes sliced from two unflattenings of one
mesh (torchtitan 0.2.2's ``dense["fsdp"]`` and ``dataloading["tp"]``), torch 2.4.

On 4 real ranks (gloo), float64: the world mesh unflattened twice, ``("batch", "tp")`` and ``("fsdp",
"tp")`` (2 x 2), a small MLP (a column-parallel Linear(4, 8), tanh, a row-parallel Linear(8, 3)) made
tensor-parallel on the first unflattening's ``tp`` and sharded by ``fully_shard`` over the second's
``fsdp``, trains 3 SGD steps, each data-parallel rank on its part of the batch; losses and full
parameters equal the same model's on one process on the full batch in the same run. On torch 2.4 with
the patch switched off, ``fully_shard`` raises 2.4's ``AssertionError`` (the two meshes' parents
differ); 2.10+ does it natively (one root for every unflattening), 2.9 with device-mesh-unflatten's
shared root. Where the patch applies, DP and TP meshes of unrelated meshes still meet 2.4's check.
"""

from conftest import (
    clean_env, gathered_tail, patch_applies_here, ranks_result, through_patch_range, where_patch_applies
)
from fsdp2_scripts import TRAIN_AGAINST_REFERENCE

PATCH_ID = "fsdp2-unflattened-meshes"

RANKS = """
import copy, datetime, json, torch, torch.nn as nn, torch.distributed as dist
# FSDP2's first home (2.4), still the same objects in 2.15 (torch.distributed.fsdp's from 2.6)
from torch.distributed._composable.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
loading = world._unflatten(0, (2, 2), ("batch", "tp"))
dense = world._unflatten(0, (2, 2), ("fsdp", "tp"))
tp_mesh, dp_mesh = loading["tp"], dense["fsdp"]
dp = dp_mesh.get_local_rank()
torch.manual_seed(0)

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))

model = MLP().double()
x, y = torch.randn(2, 5, 4, dtype=torch.float64), torch.randn(2, 5, 3, dtype=torch.float64)

def loss(m, d):
    return nn.functional.mse_loss(m(x[d]), y[d])
""" + TRAIN_AGAINST_REFERENCE + """

def fsdp_tp(tp_mesh, dp_mesh):
    m = copy.deepcopy(model)
    parallelize_module(m, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    try:
        fully_shard(m, mesh=dp_mesh)
    except AssertionError as exc:
        return None, f"AssertionError: {str(exc).splitlines()[0]}"
    return m, None

out = {}
m, out["error"] = fsdp_tp(tp_mesh, dp_mesh)
if m is not None:  # 3 SGD steps, each data-parallel rank on its batch
    out.update(train_against_reference(m, dp, 2, group=dp_mesh.get_group()))
if UNRELATED:  # DP and TP meshes of two meshes made apart
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    out["unrelated"] = fsdp_tp(tp_mesh, other["fsdp"])[1]
"""


def run(tmp_path, unrelated: bool = False, **env) -> list:
    script = RANKS.replace("UNRELATED", repr(unrelated)) + gathered_tail(PATCH_ID)
    return ranks_result(script, nproc=4, tmp_path=tmp_path, env=clean_env(**env), timeout=240)


@where_patch_applies(PATCH_ID, "torch 2.4's FSDP2 asks the DP and TP meshes for one parent")
def test_native_fully_shard_refuses_meshes_of_two_unflattenings(tmp_path):
    for out in run(tmp_path, TORCHPATCH="1", TORCHPATCH_FSDP2_UNFLATTENED_MESHES="0"):
        assert out["error"] == ("AssertionError: FSDP requires the DP and TP mesh to have the same parent mesh "
                                "but got: "), out


@through_patch_range(PATCH_ID, "FSDP2 + TP over two unflattenings of one mesh")
def test_fsdp_tp_over_two_unflattenings_trains_to_the_reference(tmp_path):
    applies = patch_applies_here(PATCH_ID)
    for out in run(tmp_path, unrelated=applies, TORCHPATCH="1"):
        assert out.pop("status") == ("applied" if applies else None), out
        assert out.pop("error") is None, out
        # float64: the same sums in another order (~1e-16); a gradient not averaged over dp: ~1e-1
        assert out.pop("loss_diff") < 1e-12 and out.pop("param_diff") < 1e-12, out
        if applies:  # anything but two unflattenings of one mesh: 2.4's check as before
            assert out.pop("unrelated").startswith("AssertionError: FSDP requires the DP and TP mesh to have"), out
        assert out == {}, out
