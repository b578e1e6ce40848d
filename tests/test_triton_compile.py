"""Static checks of the Triton kernels: every launch the dispatcher makes, compiled ahead of time
for sm_80 (A100) and sm_90 (H100) without a GPU (tests/triton_aot.py), and for Blackwell, sm_100
(B200) and sm_120 (RTX 50), at D = 512 in float16 and float32, uses tensor cores for every dtype,
compiles without spills or a stack frame (up to 16 bytes, see below) and fits the shared
memory of every GPU of its targets. sm_80 gets the float16 and float32 launches with mining on
alone, and every launch under MS_LOSS_COMPILE_ALL=1 (`make compile-check`), as tests/triton_aot.py
says."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.xdist_group("triton_compile")  # (one pytest-xdist worker: its compile is a module fixture)

HERE = os.path.dirname(os.path.abspath(__file__))
EVERYTHING = os.environ.get("MS_LOSS_COMPILE_ALL") == "1"


@pytest.fixture(scope="module")
def records():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning
    done = subprocess.run([sys.executable, os.path.join(HERE, "triton_aot.py")] + ["--all"] * EVERYTHING, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def describe(record):
    return f"{record['kernel']} {record['dtype']} D={record['dim']} mining={record['mining']} sm_{record['cc']}"


def test_every_kernel_compiles_for_both_targets(records):
    kernels = {"label_order_kernel", "divided_rows_kernel", "minpos_kernel", "capped_lifts_kernel",
               "negatives_kernel[check_ids=False][skip_range=True]",
               "negatives_kernel[check_ids=True][skip_range=True]",
               "negatives_kernel[check_ids=False][skip_range=False]", "finish_kernel[skip_range=True]",
               "finish_kernel[skip_range=False]", "scales_kernel[column_lift=False]",
               "scales_kernel[column_lift=True]", "scales_kernel[column_lift=False][half_lift]",
               "scales_kernel[column_lift=False][uniform]", "scales_kernel[column_lift=True][uniform]",
               "scales_kernel[column_lift=False][half_lift][uniform]",
               "grad_kernel[rows=True,cols=False][check_ids=False]",
               "grad_kernel[rows=False,cols=True][check_ids=False]",
               "weights_kernel[cols=False,both_lifts=False,copy=False][check_ids=False]",
               "weights_kernel[cols=False,both_lifts=False,copy=True][check_ids=False]"}
    # the self case's chunked backward in label order (its label-free tiles mirrored in each chunk's square),
    # with and without the caller's identities, and its positive ranges' launch
    kernels |= {f"weights_kernel[cols=True,both_lifts={lift},copy=False][check_ids={ids}][label_order]{launch}"
                for lift in (False, True) for ids, launch in ((False, "[mirror]"), (False, "[range_tiles]"),
                                                             (True, "[range_tiles]"))}
    # the fused backward takes the self case in label order, with and without the caller's identities
    kernels |= {f"grad_kernel[rows=True,cols=True][check_ids={ids}][label_order]" for ids in (False, True)}
    # a float16 bank compared through its norms: every kernel that computes its S
    bank = {"minpos_kernel[ref_scales]", "negatives_kernel[check_ids=False][skip_range=False][ref_scales]",
            "finish_kernel[skip_range=False][ref_scales]",
            "weights_kernel[cols=False,both_lifts=False,copy=False][check_ids=False][ref_scales]",
            "grad_kernel[rows=True,cols=False][check_ids=False][ref_scales]"}
    # the normalisation (no float32-tf32 variant)
    rows = {"unit_rows_kernel", "unit_rows_kernel[norms]", "unit_rows_grad_kernel", "stored_rows_kernel"}
    rows |= {f"unit_rows_grad_kernel[{rows}]{out}" for rows in ("ordered", "float32") for out in ("", "[to_float32]")}
    # float32 unit rows under "highest": the chunked backward's weights and rows as float16 pieces
    split = {"split_rows_kernel", "split_rows_kernel[undivided]"}
    split |= {name + "[split]" for name in kernels if name.startswith("weights_kernel")}
    for dtype in ("float16", "bfloat16", "float32", "float32-tf32"):
        for cc in (80, 90) if EVERYTHING or dtype in ("float16", "float32") else (90,):
            assert {r["kernel"] for r in records if r["dtype"] == dtype and r["cc"] == cc} == \
                kernels | (set() if dtype.endswith("-tf32") else rows) | (bank if dtype == "float16" else set()) \
                | (split if dtype == "float32" else set()) | symmetric(dtype, cc)


def symmetric(dtype, cc):
    """The self case's negatives pass on half the tiles that tests/triton_aot.py compiles for (dtype, cc):
    float32's on sm_90 shipped (three TF32 products a tile), the benchmark's triton-symmetric's for
    float16 on every target."""
    if dtype == "float16" or (dtype == "float32" and cc == 90):
        return {f"symmetric_negatives_kernel[check_ids={ids}]" for ids in (False, True)}
    return set()


def test_every_product_uses_tensor_cores(records):
    products = [r for r in records  # (the label order, finish, scales, lifts and row kernels have no product)
                if not r["kernel"].startswith(("label_order", "finish", "scales", "capped_lifts", "unit_rows",
                                               "divided_rows", "split_rows", "stored_rows"))]
    assert products
    # (the TF32 backward's 32-row tiles, which keep its 512-wide accumulator from spilling, are below
    # a Hopper warpgroup's 64 rows: mma.sync there, tensor cores still)
    # (sm_100: the float32 fused backward's 32-row tiles, below tcgen05's rows, compile to FMA there: the
    # chunked backward, a GPU's default, takes float32 on tensor cores)
    expected = {80: lambda r: r["mma_sync"], 90: lambda r: r["wgmma"] or (r["mma_sync"] and r["config"]["BLOCK_M"] < 64),
                100: lambda r: r["tcgen05"] or (r["dtype"] == "float32" and r["kernel"].startswith("grad_kernel")),
                120: lambda r: r["mma_sync"]}
    missing = [describe(r) for r in products if not expected[r["cc"]](r)]
    assert not missing, ("no mma.sync (sm_80, sm_120) / wgmma.mma_async (sm_90) / tcgen05.mma (sm_100) in: "
                         + "; ".join(missing))
    # float32: three TF32 products of split operands under precision "highest" (float32's accuracy),
    # one under "high"
    assert all(r["tf32"] and not r["tf32x3"] for r in products if r["dtype"] == "float32-tf32")
    one_product = [describe(r) for r in products if r["dtype"] == "float32" and not (r["tf32"] and r["tf32x3"])]
    assert not one_product, "float32 under precision 'highest' needs three TF32 products: " + "; ".join(one_product)


def test_blackwell_gets_every_launch_of_hopper(records):
    """sm_100 and sm_120 take the tile table's entries for capability 9.0 and up (sm_120 with its own
    K steps and float32 column blocks): each launch of the float16 and float32 step at D = 512
    compiles for them."""
    for dtype in ("float16", "float32"):
        hopper = {r["kernel"] for r in records
                  if r["dtype"] == dtype and r["cc"] == 90 and r["dim"] == 512 and r["mining"] and not r["skip"]}
        for cc in (100, 120):
            expected = (hopper - symmetric(dtype, 90)) | symmetric(dtype, cc)
            assert {r["kernel"] for r in records if r["dtype"] == dtype and r["cc"] == cc} == expected


# The most shared memory a program may take on the GPUs of each target (opt-in, per block): the
# sm_80 entries of the tile table also serve sm_86 and sm_89 (RTX 30 and 40 series, 99 KiB); sm_90
# and sm_100 227 KiB; sm_120 (RTX 50 series) 99 KiB. Triton refuses a launch above it.
SHARED_MEMORY = {80: 101376, 90: 232448, 100: 232448, 120: 101376}


def test_every_program_fits_the_shared_memory_of_its_gpus(records):
    over = [f"{describe(r)}: {r['shared']} bytes" for r in records if r["shared"] > SHARED_MEMORY[r["cc"]]]
    assert not over, "more shared memory than the GPUs of the target have:\n" + "\n".join(over)


# ptxas parks a value or two on the stack in a few launches (sm_80: float32's forward at small D and the
# 16-bit fused backward in label order; sm_100: float32's negatives pass comparing identities): up to 16
# bytes are let through; anything larger is a real spill.
SPILL_BYTES_ALLOWED = 16


def test_no_spills_and_no_stack_frame(records):
    spilling = [f"{describe(r)}: {r['spill_stores']} B stored, {r['spill_loads']} B loaded, {r['stack']} B stack, "
                f"{r['registers']} registers, {r['config']}"
                for r in records if max(r["spill_stores"], r["spill_loads"], r["stack"]) > SPILL_BYTES_ALLOWED]
    assert not spilling, "ptxas reports spills:\n" + "\n".join(spilling)
