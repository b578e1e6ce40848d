"""The Triton plans' work, counted from the launch plans themselves (triton_kernels.plan_cost): how
many GEMM-equivalents (one = 2 * B * R * D flops) a forward + backward does, and how many programs
each launch that walks every column has on a 132-multiprocessor H100. No GPU needed: the plans are
made for CPU tensors with the GPU tile table (interpret=False)."""
import pytest
import torch

triton_kernels = pytest.importorskip("ms_loss_cuda.triton_kernels")

H100 = 132
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float32-tf32": torch.float32}


def _cost(batch, dim, dtype_name, ref_rows=None, mining=True, ref_grad=True, per_class=4):
    """plan_cost of a P x M batch (per_class samples a class) against itself or a memory bank of
    ref_rows rows drawn from the same and other classes."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if dtype_name.endswith("tf32") else "highest")
    try:
        dtype = DTYPES[dtype_name]
        x, labels = torch.zeros(batch, dim, dtype=dtype), torch.arange(batch) // per_class
        ref = ref_labels = None
        if ref_rows is not None:
            ref = torch.zeros(ref_rows, dim, dtype=dtype)
            ref_labels = torch.randint(0, ref_rows // per_class, (ref_rows,), generator=torch.Generator().manual_seed(0))
        hyper = (2.0, 50.0, 0.5, 0.1, mining, False)
        _, stats, forward = triton_kernels.forward_plan(x, labels, None, ref, ref_labels, None, *hyper,
                                                        interpret=False, multiprocessors=H100)
        *_, backward = triton_kernels.backward_plan(torch.ones(batch), stats, x, labels, None, ref, ref_labels, None,
                                                    *hyper, ref_grad=ref_grad, interpret=False, multiprocessors=H100)
        return triton_kernels.plan_cost(forward + backward, batch, batch if ref is None else ref_rows, dim)
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("dim", [32, 64, 128, 256, 384, 512])
@pytest.mark.parametrize("mining", [True, False])
def test_self_case_takes_at_most_4_gemms(dtype_name, dim, mining):
    """One pass for the forward (plus the positive ranges' sliver), S once and one product in the
    backward, for every D up to 512: no recomputation of S per block of D. (384: the product runs
    on a 512-wide accumulator, a third of it padding.)"""
    cost = _cost(16384, dim, dtype_name, mining=mining)
    assert cost["gemms"] <= (3.4 if dim == 384 else 3.1), cost


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_odd_dims_pay_for_their_padding(dtype_name):
    """D = 130: rows padded to 144 (K steps of 16) and a 256-wide accumulator: counted, since the GPU
    does that work."""
    assert _cost(16384, 130, dtype_name)["gemms"] <= 4.25


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("ref_grad,limit", [(True, 5.01), (False, 3.01)])
def test_reference_set_takes_at_most_5_gemms(dtype_name, ref_grad, limit):
    """Forward 1, dx 2 and, when the reference set takes a gradient, dref 2 (a memory bank takes
    none); plus 0.005 for the positive ranges (a class has 4 rows in 65536)."""
    cost = _cost(1024, 512, dtype_name, ref_rows=65536, ref_grad=ref_grad)
    assert cost["gemms"] <= limit, cost
    assert ("_grad_kernel[dref]" in cost["programs"]) == ref_grad


def test_a_memory_bank_of_random_classes_costs_no_more():
    """A batch of 256 random classes x 4 against a bank of 65536 rows of 16384 classes: each block's
    positive list holds exactly its labels' columns (not every class between its first and last)."""
    gen = torch.Generator().manual_seed(5)
    labels = torch.randperm(16384, generator=gen)[:256].repeat_interleave(4)
    ref_labels = torch.randint(0, 16384, (65536,), generator=gen)
    x, ref = torch.zeros(1024, 512, dtype=torch.float16), torch.zeros(65536, 512, dtype=torch.float16)
    hyper = (2.0, 50.0, 0.5, 0.1, True, False)
    _, stats, forward = triton_kernels.forward_plan(x, labels, None, ref, ref_labels, None, *hyper,
                                                    interpret=False, multiprocessors=H100)
    ranges = forward[0].args["range_ptr"]
    assert int((ranges[:, 1] - ranges[:, 0]).max()) <= 128 * 16  # a block's labels have about 4 columns each
    *_, backward = triton_kernels.backward_plan(torch.ones(1024), stats, x, labels, None, ref, ref_labels, None,
                                                *hyper, ref_grad=False, interpret=False, multiprocessors=H100)
    assert triton_kernels.plan_cost(forward + backward, 1024, 65536, 512)["gemms"] <= 3.01


def test_large_classes_cost_more_but_stay_bounded():
    """Two classes of 8192: every block's positive range is half the columns, so the positive passes
    cost about one GEMM-equivalent more, and never more than two."""
    cost = _cost(16384, 512, "float16", per_class=8192)
    assert 3.5 <= cost["gemms"] <= 5.1, cost


@pytest.mark.parametrize("batch,ref_rows", [(4096, None), (256, 65536), (1024, 1048576)])
def test_launches_fill_an_h100(batch, ref_rows):
    """Every launch that walks all columns has at least two programs per multiprocessor (columns
    split where the row blocks are too few), with no atomic additions: split partials are combined in
    a fixed order afterwards."""
    cost = _cost(batch, 512, "float16", ref_rows=ref_rows)
    walking = {k: v for k, v in cost["programs"].items() if k.startswith(("_negatives", "_grad"))}
    assert len(walking) == (2 if ref_rows is None else 3)
    assert all(programs >= 2 * H100 for programs in walking.values()), cost["programs"]
