"""dtensor-explicit-redistribution: ``torch.distributed.tensor._utils.ExplicitRedistributionContext``.

On 2 ranks (gloo), DTensor ops that redistribute an argument run inside the context: an add of a
``Shard(0)`` and a ``Replicate()`` DTensor (the replicated one is chunked locally: no communication) and
a matmul of a row-sharded and a column-sharded DTensor (one is all-gathered). Each is run with
``mode="raise"``, ``strict=True``, ``mode="warn"``, nested ``enable=False``, and outside any context;
the outcome (the values against the plain tensors', or the error's type and its first words) must be
what torch 2.15 gives natively (run in its venv by the same test). Torch 2.4 and 2.9 natively lack the name
(``ImportError``, which stops the spmd_types package).
"""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, newest_torch_ranks_result, patch_applies_here, ranks_result,
    through_patch_range, where_patch_applies
)

RANKS = """
import datetime, json, logging, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
try:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
except ImportError:  # torch 2.4 natively
    from torch.distributed._tensor import Replicate, Shard, distribute_tensor
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
a, b = torch.randn(4, 6), torch.randn(4, 6)
warnings = []

class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage().split(" for ")[0])

try:
    from torch.distributed.tensor._utils import ExplicitRedistributionContext
except ImportError:
    out = {"import": "ImportError"}
else:
    logging.getLogger().addHandler(Keep())
    ops = {"add": (lambda: distribute_tensor(a, mesh, [Shard(0)]) + distribute_tensor(b, mesh, [Replicate()]), a + b),
           "matmul": (lambda: distribute_tensor(a, mesh, [Shard(0)]) @ distribute_tensor(b.T, mesh, [Shard(1)]), a @ b.T)}
    contexts = {"raise": lambda: ExplicitRedistributionContext(), "strict": lambda: ExplicitRedistributionContext(strict=True),
                "warn": lambda: ExplicitRedistributionContext(mode="warn")}
    out = {}
    for op, (run, expected) in ops.items():
        for name, make in contexts.items():
            warnings.clear()
            try:
                with make():
                    got = run()
                out[f"{op}-{name}"] = ["equal" if torch.allclose(got.full_tensor(), expected) else "differs", list(warnings)]
            except RuntimeError as exc:
                out[f"{op}-{name}"] = ["RuntimeError", str(exc).split(" for ")[0]]
        with ExplicitRedistributionContext(), ExplicitRedistributionContext(enable=False):
            out[f"{op}-disabled"] = bool(torch.allclose(run().full_tensor(), expected))
        out[f"{op}-outside"] = bool(torch.allclose(run().full_tensor(), expected))
    try:
        ExplicitRedistributionContext(mode="loud")
    except RuntimeError as exc:
        out["bad_mode"] = str(exc)
import torchpatch
out["status"] = torchpatch.status().get("dtensor-explicit-redistribution")
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, out)
if dist.get_rank() == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@where_patch_applies("dtensor-explicit-redistribution", "no ExplicitRedistributionContext")
def test_native_lacks_the_context(tmp_path):
    assert ranks_result(RANKS, tmp_path=tmp_path, env=clean_env(), timeout=180) == [
        {"import": "ImportError", "status": None}] * 2


@through_patch_range("dtensor-explicit-redistribution", "implicit redistributions observed")
def test_context_as_the_newest_torch(tmp_path):
    here = ranks_result(RANKS, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=180)
    newest = newest_torch_ranks_result(RANKS, nproc=2, tmp_path=tmp_path)
    for mine, theirs in zip(here, newest):
        assert mine.pop("status") == ("applied" if patch_applies_here("dtensor-explicit-redistribution") else None)
        theirs.pop("status")
        assert mine == theirs
        assert mine["matmul-raise"][0] == "RuntimeError", mine  # the case is not vacuous
