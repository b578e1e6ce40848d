"""The memory an eager triton step allocates with a GPU's launch plans (bench/step_memory.py, on CPU
with the launches dropped): the self case's chunked backward holds its weights buffer, the rows it
reads (unit rows, their label-ordered copy, the triangle's unlifted copy), dx in float32 and one
product's result at a time; nothing else of the step's size (a reordered copy of dx that the eager
path never reads, say); and a replayed step allocates only its gradient in the inputs' dtype, the
loss and (on CPU only) the multiply's float32 temporary. A memory bank's step holds its weights and
one chunk's unit rows of the bank within the budget, and a few copies of the batch: never the bank's
unit rows whole."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ms_loss_cuda.triton_kernels")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20


def measure(batch, bank_rows, budget, dim):
    """bench/step_memory.py's {"direct": MiB, "replayed": MiB} of one step."""
    bench = os.path.join(ROOT, "bench")
    done = subprocess.run([sys.executable, os.path.join(bench, "step_memory.py"), "--serve", ROOT, str(batch),
                           str(bank_rows or "-"), str(budget), "--dim", str(dim)], capture_output=True, text=True,
                          cwd=bench, env=dict(os.environ, PYTHONPATH=bench))
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("budget", [16, 256])
def test_a_step_holds_its_budget_and_a_few_copies_of_the_batch(budget):
    batch, dim = 4096, 512
    measured = measure(batch, None, budget, dim)
    rows = batch * dim * 2 / MIB  # (the batch in float16)
    # (whole rows at 256 MiB: all B x B weights, 32 MiB, and no unlifted copy; the triangle at 16)
    weights = min(budget, batch * batch * 2 / MIB)
    assert measured["direct"] <= weights + 6 * rows + 1, measured
    assert measured["replayed"] <= 3 * rows + 1, measured


def test_a_bank_step_holds_one_chunk_of_the_banks_unit_rows():
    batch, bank_rows, dim, budget = 1024, 65536, 512, 16
    measured = measure(batch, bank_rows, budget, dim)
    rows = batch * dim * 2 / MIB
    # a chunk's weights and unit rows (the budget), the bank's norms, reciprocals and flags; where the
    # bank's unit rows were made whole, 64 MiB more
    assert measured["direct"] <= budget + 6 * rows + 3 * bank_rows * 4 / MIB + 1, measured
    assert measured["replayed"] <= 3 * rows + 1, measured
