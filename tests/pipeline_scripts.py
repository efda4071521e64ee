"""The rank script the V-shape and interleaved schedule tests share: a stack of ``2 * world`` blocks, the
same model on one process with the full batch as the reference (its loss, the mean of the microbatches',
backwarded once), then the test's own steps, then every rank's ``out`` gathered and printed by rank 0."""

from conftest import LEAVE_WITHOUT_TEARDOWN, PIPELINING_GLOO_WARMUP, RESULT

HEAD = """
import copy, datetime, json, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import SCHEDULE, get_schedule_class
GLOO_WARMUP
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, W = dist.get_rank(), dist.get_world_size()
torch.set_default_dtype(torch.float64)
S, D, BATCH = 2 * W, 8, BATCH_SIZE
torch.manual_seed(0)
blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(S))
x, y = torch.randn(BATCH, D), torch.randn(BATCH, D)
loss_fn = nn.MSELoss()
out = {"lookup": get_schedule_class(LOOKUP) is SCHEDULE}
ref = copy.deepcopy(blocks)  # the full batch on one process: its loss is the mean of the microbatches'
ref_out = x
for b in ref:
    ref_out = b(ref_out)
loss_fn(ref_out, y).backward()
"""

TAIL = """
import torchpatch
out["status"] = torchpatch.status().get(ID)
gathered = [None] * W
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
"""


def schedule_script(schedule: str, lookup: str, batch: int, patch_id: str, body: str) -> str:
    """The rank script around ``body`` (which fills ``out``) for ``schedule`` (found by ``lookup``)."""
    head = (HEAD.replace("GLOO_WARMUP", PIPELINING_GLOO_WARMUP).replace("SCHEDULE", schedule)
            .replace("LOOKUP", repr(lookup)).replace("BATCH_SIZE", str(batch)))
    tail = TAIL.replace("RESULT", repr(RESULT)).replace("ID", repr(patch_id))
    return head + body + tail + LEAVE_WITHOUT_TEARDOWN


# The end of a rank script whose ranks each put their own keys in ``out``: rank 0 prints them merged,
# with ``status`` the patch's status on every rank, in rank order.
MERGED_TAIL = """
import torchpatch
out["status"] = torchpatch.status().get(ID)
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, out)
if dist.get_rank() == 0:
    merged = {}
    for o in gathered:
        merged.update(o)
    merged["status"] = [o["status"] for o in gathered]
    print(RESULT + json.dumps(merged), flush=True)
"""


def merged_tail(patch_id: str) -> str:
    """:data:`MERGED_TAIL` for ``patch_id``, then the rank's exit without teardown."""
    return MERGED_TAIL.replace("RESULT", repr(RESULT)).replace("ID", repr(patch_id)) + LEAVE_WITHOUT_TEARDOWN
