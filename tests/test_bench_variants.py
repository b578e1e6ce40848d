"""The benchmark's variants of the Triton backend (bench/triton_internals.py) compute the same loss:
triton-unsplit's float32 backward products (one float32 product each, without the shipped float16
pieces) give the shipped gradient within float32's tolerance; triton-fp16x3's, triton-resident's and
triton-symmetric's tiles the float64 reference's; the shipped table takes the symmetric pass where it
says (float32 on sm_90) and triton-unsymmetric's nowhere; and bench/gpu_check.sh names only providers
the benchmark knows."""
import os
import sys

import pytest
import torch

pytest.importorskip("ms_loss_cuda.triton_kernels")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from providers import make_inputs  # noqa: E402


@pytest.mark.parametrize("bank", [False, True])
def test_unsplit_products_give_the_shipped_gradient(monkeypatch, bank):
    import ms_loss_cuda
    import triton_internals
    from ms_loss_cuda.triton_kernels import backward

    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "1e-6")  # the chunked backward: its products by torch
    x0, labels, ref, ref_labels = make_inputs(37, 24, ref_rows=53 if bank else None)
    shipped, weights = backward.Product.__call__, []
    monkeypatch.setattr(backward.Product, "__call__", lambda product: (weights.append(product.w.dtype),
                                                                        shipped(product))[1])

    def step(x):
        ms_loss_cuda.multi_similarity_loss(x, labels, ref_embeddings=ref, ref_labels=ref_labels,
                                           backend="triton").backward()

    grads, dtypes = [], []
    for run in (step, triton_internals.within(step, triton_internals.unsplit_products)):
        x = x0.clone().requires_grad_()
        weights.clear()
        run(x)
        grads.append(x.grad)
        dtypes.append(set(weights))
    assert grads[0].abs().max() > 0
    assert dtypes == [{torch.float16}, {torch.float32}]  # (the shipped pieces, then float32 weights)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5 * grads[0].abs().max().item())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bank", [False, True])
def test_fp16x3_tiles_hold_float32_accuracy(reduction, bank):
    """triton-fp16x3's S tiles (three float16 products of split unit rows, pairs.similarity_tile) against
    the float64 reference: the interpreter rounds the float16 parts as a GPU does."""
    import ms_loss_cuda
    import triton_internals

    x0, labels, ref, ref_labels = make_inputs(37, 24, ref_rows=53 if bank else None)

    def loss_and_grad(x, ref, backend):
        x = x.clone().requires_grad_()
        loss = ms_loss_cuda.multi_similarity_loss(x, labels, ref_embeddings=ref, ref_labels=ref_labels,
                                                  reduction=reduction, backend=backend)
        loss.backward(torch.tensor(0.5, dtype=loss.dtype))
        return loss.detach().double(), x.grad.double()

    expected = loss_and_grad(x0.double(), None if ref is None else ref.double(), "reference")
    with triton_internals.tiles(triton_internals.fp16x3_tiles()):
        got = loss_and_grad(x0, ref, "triton")
    assert abs(got[0] - expected[0]) <= 1e-5 * abs(expected[0])
    assert (got[1] - expected[1]).abs().max() <= 1e-5 * expected[1].abs().max()


# (the chunked backward's label-free tiles take a positive range's pairs as negatives, whose weights can
# pass float16's range as pieces; the range's launch rewrites them. Zeroing every piece above 60,000 leaves
# this test passing: the interpreter's numpy warns of casts whose results are never read)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp16x3_tiles_on_the_symmetric_pass(monkeypatch, reduction):
    """triton-fp16x3 on an H100's tile table, where float32's negatives pass is the symmetric one, under
    the interpreter: three row blocks of 128 (B = 300), each tile's three float16 products summed for
    its rows and its columns, against the float64 reference."""
    import triton_internals
    from conftest import check_against_reference
    from targets import DEVICE, gpu_tile_table, recorded_launches, triton_kernels

    if triton_kernels is None or DEVICE != "cpu" or not triton_kernels.INTERPRETED:
        pytest.skip("runs an H100's tiles under the interpreter (on a GPU the benchmark runs them)")
    gpu_tile_table(monkeypatch, (9, 0))
    x, labels, _, _ = make_inputs(300, 24)
    launches = recorded_launches(monkeypatch)
    with triton_internals.tiles(triton_internals.fp16x3_tiles()):
        check_against_reference("triton", dict(embeddings=x, labels=labels), torch.float32, reduction, device=DEVICE,
                                rtol=1e-5)
    names = [(launch.kernel.fn.__name__, launch.constexprs.get("PRECISION")) for launch in launches]
    assert ("symmetric_negatives_kernel", "fp16x3") in names, names


@pytest.mark.parametrize("case", ["self", "self_ids", "ref", "ref_ids"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_resident_rows_give_the_reference_loss(monkeypatch, case, dtype):
    """triton-resident (each program's rows loaded once, whole, and kept for every column tile:
    pairs.resident_rows): the negatives kernel, and the chunked backward's weights, 2 column tiles a
    program, over several chunks (the triangle in the self case), on rows whose padded D (48) is not
    the power of 2 the kept rows take (64). float16 against the float64 reference; bfloat16 against
    the shipped tiles (its unit rows, rounded to 8 bits, with beta = 50 in the weights, take its
    gradients percents from the float64 ones at this size). A float16 reference set that takes no
    gradient is compared through its norms, a bfloat16 one takes a gradient (dref's copy of the
    weights). On a GPU the kernels run there (the variant needs the shared memory of sm_90 and sm_100)."""
    import triton_internals
    from conftest import assert_close, build_case, check_against_reference, loss_and_grads, to
    from ms_loss_cuda.triton_kernels import launcher
    from targets import DEVICE, TRITON_MISSING, recorded_launches

    if TRITON_MISSING["condition"]:
        pytest.skip(TRITON_MISSING["reason"])
    if DEVICE == "cuda" and not (9, 0) <= torch.cuda.get_device_capability() < (12, 0):
        pytest.skip("the variant needs the shared memory of sm_90 and sm_100")
    # the chunked backward on chunks of several column tiles (a bank's) or two row blocks (the triangle's first)
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "0.05")
    monkeypatch.setattr(triton_internals, "WEIGHTS_COLUMN_TILES", 2)  # (several programs a chunk, the last short)
    kwargs, ref_grad = build_case(case, 150, 40, dtype, seed=4), dtype == torch.bfloat16
    if dtype == torch.bfloat16:
        def grad_output(loss):
            return torch.full_like(loss, 0.7)

        shipped = loss_and_grads(to(kwargs, DEVICE), "triton", grad_output, ref_grad, reduction="sum")
    recorded = recorded_launches(monkeypatch)
    # (the triangle from any chunk height: a GPU's table takes it from 1024 rows, the interpreter's from a block)
    with triton_internals.tiles(launcher.with_triangle_rows(1, triton_internals.resident_tiles())):
        if dtype == torch.float16:
            check_against_reference("triton", kwargs, dtype, "sum", device=DEVICE, ref_grad=ref_grad)
        else:
            loss, grads = loss_and_grads(to(kwargs, DEVICE), "triton", grad_output, ref_grad, reduction="sum")
            assert_close(loss, shipped[0], 1e-2)
            for g, expected in zip(grads, shipped[1]):
                assert_close(g, expected, 1e-2)
    launches = [(launch.kernel.fn.__name__, launch.constexprs) for launch in recorded]
    negatives = [c for name, c in launches if name == "negatives_kernel"]
    weights = [c for name, c in launches if name == "weights_kernel" and not c["RANGE_TILES"]]
    assert negatives and all(c["RESIDENT_D"] == 64 for c in negatives)
    assert weights and all(c["RESIDENT_D"] == 64 and c["COLUMN_TILES"] > 1 for c in weights)
    assert any(c["BOTH_LIFTS"] for c in weights) == case.startswith("self")  # (the triangle)


# (batch, multiprocessors, case, mining): see the test's docstring
SYMMETRIC_CASES = [(40, 4, "self", True), (100, 4, "self", True), (430, 4, "self", True), (640, 8, "self", True),
                   (640, 20, "self", True), (640, 8, "self", False), (430, 4, "shared_ids", True),
                   (640, 8, "shared_ids", True), (430, 4, "self_ids", True), (430, 4, "large_classes", True),
                   (640, 8, "large_classes", True), (430, 4, "unnormalised", True), (640, 8, "unnormalised", True),
                   (430, 4, "base_below_0", False)]
# float16 walks the same tiles: its casts are checked on an odd and an even count of row blocks, with
# identities, unnormalised rows and the padding columns
FLOAT16_CASES = [(430, 4, "unnormalised", True), (640, 8, "shared_ids", True), (430, 4, "base_below_0", False)]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype, batch, multiprocessors, case, mining",
                         [(torch.float32, *case) for case in SYMMETRIC_CASES]
                         + [(torch.float16, *case) for case in FLOAT16_CASES])
def test_symmetric_negatives_give_the_reference_loss(monkeypatch, batch, multiprocessors, case, mining, dtype):
    """triton-symmetric (forward_kernels.symmetric_negatives_kernel: each tile of S once, summed for its
    rows and its columns): each anchor's loss ("none", a random grad_output) and the gradient, in
    float32 against the float64 reference. float16 against the shipped pass on the same rows: at these
    batches some negatives lie within float16's rounding of their mining threshold, where both passes
    differ from the reference alike. Under the interpreter the row blocks are 64 rows: 1 and 2 of
    them, 7 (odd: every block goes half-way round; the last one partial) and 10 (even: the pairs at
    distance 5 once, from the lower block; on 8 multiprocessors, parts of two distances, one of them
    empty for the upper blocks; on 20, five parts of one). shared_ids: identities shared by rows of
    different labels, which the pass must then compare; self_ids: distinct ones, which it need not;
    large_classes: 3 classes, whose positive ranges span several blocks; unnormalised: rows compared
    as they are, whose sums need their shifts; base_below_0 (mining off, negatives at S = -1/24): the
    last block's padding columns, S = 0, would outweigh them if either end took them. A tile left out or counted twice
    changes its anchors' negative sums. On a GPU the row blocks are 128 rows (B = 640: 5 of them).
    (The interpreter's numpy warns of the overflow of unnormalised terms outside the mined sets,
    which their selection then drops.)"""
    import triton_internals
    from conftest import assert_close, build_case, check_against_reference, loss_and_grads, make_batch, to
    from ms_loss_cuda.triton_kernels import launcher
    from targets import DEVICE, TRITON_MISSING, recorded_launches

    if TRITON_MISSING["condition"]:
        pytest.skip(TRITON_MISSING["reason"])
    if DEVICE == "cuda" and dtype == torch.float32 and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the variant takes float32 on sm_90 only (triton_internals.symmetric_tiles)")
    if DEVICE != "cuda":
        monkeypatch.setattr(launcher, "device_multiprocessors", lambda device, interpret=False: multiprocessors)
    kwargs = build_case("self_ids" if case == "self_ids" else "self", batch, 24, dtype, seed=1)
    if case == "large_classes":
        kwargs["embeddings"], kwargs["labels"] = make_batch(batch, 24, 3, dtype=dtype, seed=1, spread=3.0)
    if case == "shared_ids":
        kwargs["ids"] = torch.arange(batch) // 2  # (neighbours share one identity, mostly across labels)
    options = dict(reduction="none", mining=mining, normalize=case != "unnormalised")
    if case == "base_below_0":  # 25 classes at the corners of a simplex (negatives at S = -1/24), every
        # negative counted and S = 0 weighing exp(25): a padding column taken for a negative would dominate
        gen = torch.Generator().manual_seed(1)
        labels = torch.randint(0, 25, (batch,), generator=gen)
        centres = torch.eye(25, 24 + 1) - 1 / 25
        kwargs["embeddings"] = (centres[labels] + 0.02 * torch.randn(batch, 25, generator=gen)).to(dtype)
        kwargs["labels"] = labels
        options["base"] = -0.5
    if case == "unnormalised":  # rows of norm about 1.7: exponents up to about 125, past float32's range unshifted
        kwargs["embeddings"] = kwargs["embeddings"] / 4

    def grad_output(loss):
        return torch.randn(loss.shape, generator=torch.Generator().manual_seed(3)).to(loss.device, loss.dtype)

    if dtype == torch.float16:
        shipped = loss_and_grads(to(kwargs, DEVICE), "triton", grad_output, **options)
    recorded = recorded_launches(monkeypatch)
    with triton_internals.tiles(triton_internals.symmetric_tiles()):
        if dtype == torch.float32:
            check_against_reference("triton", kwargs, dtype, device=DEVICE, **options)
        else:
            loss, grads = loss_and_grads(to(kwargs, DEVICE), "triton", grad_output, **options)
            assert_close(loss, shipped[0], 1e-3)  # (float16 losses: a 32-bit difference may round one ulp apart)
            assert_close(grads[0], shipped[1][0], 1e-3)
    launches = [(launch.kernel.fn.__name__, launch.grid, launch.constexprs) for launch in recorded]
    (grid, constexprs), = [(grid, c) for name, grid, c in launches if name.endswith("negatives_kernel")]
    assert [name for name, *_ in launches].count("symmetric_negatives_kernel") == 1, launches
    assert constexprs["CHECK_IDS"] == (case in ("shared_ids", "self_ids"))
    if DEVICE != "cuda" and batch == 640:
        assert grid == ((10, 5) if multiprocessors == 20 else (10, 3))


def test_symmetric_negatives_keep_the_shipped_pass_past_their_memory(monkeypatch):
    """A batch whose symmetric partials would pass SYMMETRIC_PARTIALS_BYTES takes negatives_kernel."""
    import triton_internals
    from conftest import build_case, check_against_reference
    from ms_loss_cuda.triton_kernels import forward
    from targets import DEVICE, TRITON_MISSING, recorded_launches

    if TRITON_MISSING["condition"]:
        pytest.skip(TRITON_MISSING["reason"])
    monkeypatch.setattr(forward, "SYMMETRIC_PARTIALS_BYTES", 3 * 4 * 300 * 3)  # (300 rows: 4 slots needed)
    launches = recorded_launches(monkeypatch)
    with triton_internals.tiles(triton_internals.symmetric_tiles()):
        check_against_reference("triton", build_case("self", 300, 24, torch.float32), torch.float32, "none",
                                device=DEVICE)
    names = [launch.kernel.fn.__name__ for launch in launches]
    assert "negatives_kernel" in names and "symmetric_negatives_kernel" not in names


@pytest.mark.parametrize("dtype, capability, symmetric", [(torch.float32, (9, 0), True), (torch.float32, (10, 0), False),
                                                     (torch.float32, (8, 0), False), (torch.float32, (12, 0), False),
                                                     ("float32-tf32", (9, 0), False), (torch.float16, (9, 0), False),
                                                     (torch.bfloat16, (9, 0), False)])
def test_float32_on_sm90_ships_the_symmetric_pass(monkeypatch, dtype, capability, symmetric):
    """The GPU tile table's self-case negatives pass (plans only, on CPU tensors): symmetric for float32
    at torch's default precision (three TF32 products a tile) on sm_90 alone, never for a reference
    set, and never on triton-unsymmetric's table."""
    import triton_internals
    from conftest import build_case
    from ms_loss_cuda.triton_kernels import forward_plan, launcher

    if dtype == "float32-tf32":
        monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
        dtype = torch.float32

    def negatives(case, table=launcher.tile_config):
        kwargs = build_case(case, 512, 64, dtype)
        with triton_internals.tiles(table):
            *_, launches = forward_plan(kwargs["embeddings"], kwargs["labels"], None, kwargs.get("ref_embeddings"),
                                        kwargs.get("ref_labels"), None, 2.0, 50.0, 0.5, 0.1, True, False,
                                        interpret=False, capability=capability, multiprocessors=132)
        names = [launch.kernel.fn.__name__ for launch in launches]
        return [name for name in names if name.endswith("negatives_kernel")]

    assert negatives("self") == ["symmetric_negatives_kernel" if symmetric else "negatives_kernel"]
    assert negatives("ref") == ["negatives_kernel"]
    assert negatives("self", triton_internals.unsymmetric_tiles()) == ["negatives_kernel"]


@pytest.mark.parametrize("provider, budget", [("triton", None), ("triton-fused", "0"), ("triton-chunk192", "192"),
                                              ("triton-chunk128", "128")])
def test_triton_providers_run_under_the_budget_they_name(monkeypatch, provider, budget):
    import ms_loss_cuda
    from providers import step_function

    seen = []

    def recorded(x, labels, **kwargs):
        seen.append((os.environ.get("MS_LOSS_TRITON_CHUNK_MB"), kwargs["backend"]))
        return x.sum()

    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "7")  # (the caller's setting: each provider sets its own)
    monkeypatch.setattr(ms_loss_cuda, "multi_similarity_loss", recorded)
    x, labels, _, _ = make_inputs(8, 4)
    step_function(provider, labels)(x.requires_grad_())
    assert seen == [(budget, "triton")]


@pytest.mark.parametrize("provider", ["cpu", "cpu-ops"])
def test_cpu_ops_runs_the_traced_path_of_the_cpu_backend(monkeypatch, provider):
    """cpu-ops calls the cpu backend with ops.traced() true (its custom ops, torch's normalisation and
    reduction) and restores it after each step; cpu takes the one-node eager path."""
    import ms_loss_cuda
    from ms_loss_cuda import ops
    from providers import step_function

    seen = []

    def recorded(x, labels, **kwargs):
        seen.append((ops.traced(), kwargs["backend"]))
        return x.sum()

    monkeypatch.setattr(ms_loss_cuda, "multi_similarity_loss", recorded)
    x, labels, _, _ = make_inputs(8, 4)
    step_function(provider, labels)(x.requires_grad_())
    assert seen == [(provider == "cpu-ops", "cpu")] and not ops.traced()


def test_the_gpu_check_names_only_providers_the_benchmark_knows():
    """A provider name that bench/gpu_check.sh passes to the benchmark or the kernel times and that they
    do not know would fail on a GPU machine only, after its time is spent."""
    import re

    from providers import PROVIDERS

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "bench", "gpu_check.sh")) as f:
        script = f.read().replace("\\\n", " ")
    named = set()
    for providers in re.findall(r"--providers\s+(.*?)(?=\s--|\s;;|\n)", script):
        names = providers.replace("${KERNEL_PROVIDERS:-", "").replace("}", "").split()
        named.update(name for name in names if "$" not in name)  # ($tuned and its --tuned: a sweep's)
    assert {"triton", "triton-unmirrored", "compiled", "pml"} <= named
    assert named <= set(PROVIDERS) | {"ours"}, named - set(PROVIDERS)  # (ours: bench/memory_benchmark.py's)
