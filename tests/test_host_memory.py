"""On CPU a rank allocates as train.host_memory says (toolkit/process/host_memory.py): `predictable` gives a freed
tensor's pages back, so the resident set follows the live tensors and `toolkit plan` can predict its peak;
`fast` keeps freed pages for the next allocation, so a step's tensors come without page faults."""

import subprocess
import sys

from conftest import REPO, toolkit_env

from toolkit.process import host_memory

STEP = r"""
import sys, psutil, torch
from toolkit.process import host_memory
if sys.argv[1] != "glibc":
    assert host_memory.apply(sys.argv[1])
rss = lambda: psutil.Process().memory_info().rss / 2**20
warm = torch.empty(8 << 20, dtype=torch.uint8); warm.fill_(1); del warm  # glibc's threshold rises to 8 MiB
size = int(sys.argv[2])
temporaries, kept = [], []
for _ in range((160 << 20) // size):  # a step's transients (160 MiB), each followed by a small tensor that stays
    t = torch.empty(size, dtype=torch.uint8); t.fill_(1); temporaries.append(t)
    k = torch.empty(16 << 10, dtype=torch.uint8); k.fill_(1); kept.append(k)
before = rss(); temporaries.clear()
print(before - rss())
"""

# steps of a model with an embedding-sized gradient (30522 x 384 fp32: 47 MB, above glibc's largest mmap
# threshold), two micro-batches each (the second's gradient is made, added to the first's, freed) and AdamW:
# the page faults of each of 8 steps once the first two have set up the optimizer state
STEPS = r"""
import resource, sys, torch
from toolkit.process import host_memory
if sys.argv[1] != "glibc":
    assert host_memory.apply(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(30522, 384), torch.nn.Linear(384, 2))
optimizer = torch.optim.AdamW(model.parameters())
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():
    for _ in range(2):
        model(torch.randint(0, 30522, (16, 64))).sum().backward()
    optimizer.step(); optimizer.zero_grad(set_to_none=True)
step(); step()
counts = []
for _ in range(8):
    before = faults(); step(); counts.append(faults() - before)
print(sorted(counts)[len(counts) // 2])  # the median step
"""


def run_snippet(code: str, *args: str) -> float:
    result = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=toolkit_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return float(result.stdout.strip())


def test_predictable_host_memory_gives_freed_tensors_back():
    # glibc's default: the 160 MiB of freed transients sit between kept tensors on the heap and stay resident
    # (measured: 0 MiB returned); with the predictable threshold each had pages of its own (measured: 156)
    assert run_snippet(STEP, "glibc", str(4 << 20)) < 40
    assert run_snippet(STEP, "predictable", str(4 << 20)) > 140
    # a short sequence's activations (512 KiB: 128 tokens x hidden 1024 in fp32) too: under a 1 MiB threshold
    # they came from the heap and stayed resident
    assert run_snippet(STEP, "predictable", str(512 << 10)) > 140


def test_fast_host_memory_steps_without_page_faults():
    gradient_pages = 30522 * 384 * 4 // 4096  # 11,447 pages of 4 KiB
    # glibc maps each such tensor afresh: every page faulted in and zeroed again (measured: 45,784 faults a step,
    # predictable 47,326), the cost behind the default MiniLM job's 0.98× and 0.63× of the Trainer
    assert run_snippet(STEPS, "glibc") > 2 * gradient_pages
    assert run_snippet(STEPS, "predictable") > 2 * gradient_pages
    # fast: the heap keeps freed pages and the next tensors take them (measured: 0 or 1 fault in most steps). The
    # median, as the heap still grows now and then where a gradient finds no hole large enough among the others
    # (measured: one step in ten faults one gradient's 11,445 pages, once), where glibc faults every micro-batch
    assert run_snippet(STEPS, "fast") < gradient_pages / 100


def test_auto_takes_fast_only_with_room_for_its_high_water_mark():
    GiB = 2 ** 30
    assert host_memory.choose("auto", predicted_peak_bytes=1 * GiB, memory_per_rank_bytes=12 * GiB) == "fast"
    assert host_memory.choose("auto", predicted_peak_bytes=3 * GiB + 1, memory_per_rank_bytes=12 * GiB) == \
        "predictable"
    assert host_memory.choose("auto", predicted_peak_bytes=None, memory_per_rank_bytes=12 * GiB) == "predictable"
    for setting in ("fast", "predictable"):  # a setting is kept whatever the room
        assert host_memory.choose(setting, predicted_peak_bytes=100 * GiB, memory_per_rank_bytes=GiB) == setting
        assert host_memory.choose(setting, predicted_peak_bytes=1, memory_per_rank_bytes=100 * GiB) == setting
