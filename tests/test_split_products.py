"""The chunked backward's float32 products as float16 pieces (backward.split_products): under torch's
float32 matmul precision "highest", unit rows of float32 (the eager loss's under `normalize`) enter
cuBLAS as high parts and scaled rests, three float16 products where one float32 product would run on
CUDA cores. Against the float64 reference in every shape of the chunked backward, and with float32
products wherever the pieces do not apply."""
import pytest
import torch

from conftest import build_case, check_against_reference, make_batch
from targets import DEVICE, TOLERANCE, TRITON_MISSING, chunk_choices, in_turn

pytestmark = pytest.mark.skipif(**TRITON_MISSING)


def product_dtypes(monkeypatch):
    """[(w's dtype, whether it came with rests)] of every backward.Product run after this."""
    from ms_loss_cuda.triton_kernels import backward

    seen, shipped = [], backward.Product.__call__
    monkeypatch.setattr(backward.Product, "__call__",
                        lambda product: (seen.append((product.w.dtype, product.w_lo is not None)), shipped(product)))
    return seen


# the pieces keep a float32 product's error: about 6e-7 of the largest entry here under the interpreter,
# as float32 products (on a GPU the S tiles' three TF32 products add theirs: float32's tolerance there)
PIECES_RTOL = 3e-6 if DEVICE == "cpu" else TOLERANCE[torch.float32]


@pytest.mark.parametrize("case,triangle_rows,batch,dim,reduction",
                         in_turn(["none", "mean", "sum"], [("self", 1), ("self", 10 ** 9), ("ref_ids", None),
                                                           ("bank", None)], [(151, 37), (197, 130)]))
def test_float32_unit_rows_multiply_as_float16_pieces(monkeypatch, case, triangle_rows, batch, dim, reduction):
    """The triangle (both products, its rows divided by their lifts), chunks of whole rows, a reference
    set with its gradient (dref's products from the copy's pieces) and a memory bank (each chunk's rows
    split for its product): several chunks each, the products in pieces of 8 rows (so that pieces
    begin inside chunks), odd sizes, against the float64 reference at a float32 product's error."""
    from ms_loss_cuda.triton_kernels import backward

    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "0.01")
    monkeypatch.setattr(backward, "LEAST_PIECE_ROWS", 8)
    chosen = chunk_choices(monkeypatch, triangle_rows)
    seen = product_dtypes(monkeypatch)
    kwargs = build_case("self" if case == "self" else "ref_ids", batch, dim, torch.float32, seed=3)
    check_against_reference("triton", kwargs, torch.float32, reduction, device=DEVICE, ref_grad=case != "bank",
                            rtol=PIECES_RTOL)
    assert seen and set(seen) == {(torch.float16, True)}
    assert chosen and all(len(chunks) > 1 and triangle == (triangle_rows == 1) for chunks, triangle in chosen)


def test_crossbatchmemory_steps_multiply_as_float16_pieces(monkeypatch):
    """CrossBatchMemory's one-call step normalises the batch before its two terms, which take the pieces
    (its warm-up calls go through the loss on rows it normalised itself: float32 products there)."""
    import test_memory

    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "1e-6")
    seen = product_dtypes(monkeypatch)
    test_memory.test_matches_a_memory_kept_by_hand(monkeypatch, "triton", "sum", True)
    assert (torch.float16, True) in seen


@pytest.mark.parametrize("how", ["unnormalised", "tf32", "fp16 accumulation"])
def test_float32_products_stay_float32_where_pieces_do_not_apply(monkeypatch, how):
    """Rows left unnormalised (their magnitude is the caller's: float16 pieces could overflow), TF32
    allowed (cuBLAS's TF32 product is as precise as asked), and float16 sums allowed in cuBLAS (which
    then refuses float32 results of float16 products): float32 weights and products."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "0.05")
    seen = product_dtypes(monkeypatch)
    x, labels = make_batch(150, 40, 25, dtype=torch.float32, seed=5)
    kwargs = dict(embeddings=torch.nn.functional.normalize(x, dim=1) * 1.25, labels=labels)
    precision = torch.get_float32_matmul_precision()
    accumulation = torch.backends.cuda.matmul.allow_fp16_accumulation
    try:
        if how == "tf32":
            torch.set_float32_matmul_precision("high")
        torch.backends.cuda.matmul.allow_fp16_accumulation = how == "fp16 accumulation"
        if how == "unnormalised":
            check_against_reference("triton", kwargs, torch.float32, "sum", device=DEVICE, normalize=False)
        else:
            from ms_loss_cuda import multi_similarity_loss

            multi_similarity_loss(kwargs["embeddings"].to(DEVICE).requires_grad_(), labels.to(DEVICE),
                                  backend="triton").backward()
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cuda.matmul.allow_fp16_accumulation = accumulation
    assert seen and set(seen) == {(torch.float32, False)}


def test_the_pieces_hold_a_float32_product():
    """float16_parts, as the kernels write them (split_rows_kernel), give back float32 rows to about
    2^-22 of each value from float16's normal range up, and products as w b + (w b_lo + w_lo b) / 2^11
    within float32's tolerance of the float64 product, where one float16 product misses by far more."""
    from ms_loss_cuda.triton_kernels import launcher, row_kernels

    gen = torch.Generator().manual_seed(7)
    rows = torch.nn.functional.normalize(torch.randn(70, 130, generator=gen), dim=1)
    rows[3, :5] = torch.tensor([1.0, -1.0, 3e-4, -6.2e-5, 0.0])  # (the extremes of a unit row that keep 2^-22)
    rows = rows.to(DEVICE)
    pieces = torch.empty(70, 288, dtype=torch.float16, device=DEVICE)  # (the rests from column 144 on)
    launcher.run(lambda: [[row_kernels.rows_launch(row_kernels.split_rows_kernel, rows.shape, dict(DIVIDE=False),
                                                   t_ptr=rows, divisor_ptr=rows, y_ptr=pieces, half=144)]],
                 rows.device)
    hi, lo = pieces[:, :130].double().cpu(), pieces[:, 144:274].double().cpu()
    exact = rows.double().cpu()
    assert torch.equal(hi, exact.half().double())  # (rounded to nearest)
    normal = exact.abs() >= 2.0 ** -14
    assert ((hi + lo / 2048 - exact).abs() <= 2.0 ** -22 * exact.abs())[normal].all()
    weights = torch.rand(50, 70, generator=gen, dtype=torch.float64)
    w_hi = weights.half().double()
    w_lo = ((weights - w_hi) * 2048).half().double()
    product = w_hi @ hi + (w_hi @ lo + w_lo @ hi) / 2048
    want = weights @ exact
    scale = want.abs().max()
    assert (product - want).abs().max() <= TOLERANCE[torch.float32] * scale / 10
    assert (w_hi @ hi - want).abs().max() > 10 * TOLERANCE[torch.float32] * scale


@pytest.mark.parametrize("case,reduction", [("self", "mean"), ("ref_ids", "none")])
def test_a_batch_whose_weights_are_all_small_keeps_float32_precision(monkeypatch, case, reduction):
    """Every anchor's weights about e^-25 (no positives, nearly orthogonal rows: negatives near S = 0
    under beta = 50, mining off): lifted towards 1 by their own lifts, which here pass the 2^14 that a
    row holding its column anchors' weights takes when those may be 1 (whole rows: capped_lifts_kernel,
    relative to the smallest lift; dref: the smallest lift itself). A fixed cap of 2^14 left them where
    the pieces keep about 1e-4 of them (float16's subnormal step, 2^-24, in the rests)."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "0.01")
    chosen = chunk_choices(monkeypatch, 10 ** 9)
    seen = product_dtypes(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    rows = 150 + (80 if case == "ref_ids" else 0)
    x = torch.eye(rows, 240, dtype=torch.float64) + 0.005 * torch.randn(rows, 240, generator=gen, dtype=torch.float64)
    kwargs = dict(embeddings=x[:150].float(), labels=torch.arange(150))
    if case == "ref_ids":
        kwargs.update(ref_embeddings=x[150:].float(), ref_labels=torch.arange(150, rows), ids=torch.arange(150),
                      ref_ids=torch.arange(150, rows))
    check_against_reference("triton", kwargs, torch.float32, reduction, device=DEVICE, rtol=PIECES_RTOL, mining=False)
    assert seen and set(seen) == {(torch.float16, True)}
    assert case != "self" or chosen and all(len(chunks) > 1 and not triangle for chunks, triangle in chosen)


def test_a_reference_set_that_is_the_batch_tensor_itself_keeps_its_lifts(monkeypatch):
    """The op's backward with the reference set the very tensor x and no dref (the plan's b is its a):
    each anchor row keeps its own lift, as for a copy of x, not the self case's capped one (which would
    read a minimum that scales_kernel did not take there). Weights about e^-25, grad_output 1e-3."""
    from ms_loss_cuda.triton_kernels import op

    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "0.01")
    gen = torch.Generator().manual_seed(0)
    x = torch.eye(96, 128, dtype=torch.float64) + 0.005 * torch.randn(96, 128, generator=gen, dtype=torch.float64)
    x = torch.nn.functional.normalize(x, dim=1).half().to(DEVICE)
    labels = ids = torch.arange(96, device=DEVICE)
    hyper = (2.0, 50.0, 0.5, 0.1, False, False)  # (alpha, beta, base, epsilon, mining, skip_incomplete_anchors)
    _, stats = op._forward(x, labels, ids, x, labels + 96, ids, *hyper)
    grad_output = torch.full((96,), 1e-3, device=DEVICE)
    same, copied = (op.backward_of_checked_inputs(grad_output, stats, x, labels, ids, ref, labels + 96, ids, *hyper,
                                                  ref_grad=False, float32=True)[0] for ref in (x, x.clone()))
    assert copied.abs().max() > 0 and torch.equal(same, copied)
