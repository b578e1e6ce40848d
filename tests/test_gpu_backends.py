"""The fused backends against the float64 reference: one suite, run for every target available.

- cpu: the fused CPU kernel (csrc/ms_loss_cpu.cpp), the GPU backends' edge cases included
  (tests/test_cpu_kernel.py checks what only it has: float64, the pair weights it keeps);
- triton: on CUDA tensors when a GPU is present, else under TRITON_INTERPRET=1 on CPU tensors
  (conftest sets it before the kernels are imported);
- cuda: on CUDA tensors; needs a GPU and the CUDA kernels built (else skipped);
- cuda_emulated: the CUDA backend's kernels and host logic (csrc/cuda/ms_loss_kernels.cuh) built
  by the host compiler on tests/cuda_emulation/cuda_on_cpu.h, every block's threads run as CPU
  threads: the thread mapping, tiles, barriers and WMMA operand layouts of the CUDA kernels,
  checked without a GPU (tests/test_cuda_compile.py checks what nvcc makes of them).
"""
import itertools
import os
import shutil
import warnings
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import cpp_extension
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ms_loss_cuda import loss as api, multi_similarity_loss, ops

from conftest import (assert_close, build_case, check_against_reference, label_order_by_torch, loss_and_grads,
                      make_batch, to)

try:
    import ms_loss_cuda.triton_kernels as triton_kernels
except ImportError:
    triton_kernels = None

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HERE = os.path.dirname(os.path.abspath(__file__))
# the issues' targets: 1e-5 relative in float32; float16 / bfloat16 rounding of the weights that
# enter the second product (interpreted bfloat16 tiles are upcast, so that case is tighter there)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


class Target(NamedTuple):
    name: str  # the fixture's parameter
    backend: str  # the name multi_similarity_loss takes
    device: str
    forward: object  # the fused ops
    backward: object
    chunked: bool = False  # triton's chunked backward: cuBLAS sums dx in chunks that depend on ref_grad


@pytest.fixture(scope="session")
def emulated_cuda_ops(tmp_path_factory):
    """Builds tests/cuda_emulation/emulated_ms_loss.cpp and gives its fused ops autograd. The build
    directory is shared by the run's pytest-xdist workers (each worker's base is a child of the
    run's): the first builds (about 25 s), the others wait for its lock and load the result."""
    run_base = tmp_path_factory.getbasetemp()
    build_directory = (run_base.parent if os.environ.get("PYTEST_XDIST_WORKER") else run_base) / "cuda_emulation"
    build_directory.mkdir(exist_ok=True)
    cpp_extension.load(
        name="ms_loss_cuda_emulated", sources=[os.path.join(HERE, "cuda_emulation", "emulated_ms_loss.cpp")],
        extra_include_paths=[os.path.join(os.path.dirname(HERE), "csrc"), os.path.join(HERE, "cuda_emulation")],
        extra_cflags=["-O2", "-std=c++20", "-pthread", "-fno-strict-aliasing", "-Wno-unknown-pragmas"],
        extra_ldflags=["-pthread"], build_directory=str(build_directory),
        is_python_module=False)
    emulated = torch.ops.ms_loss_cuda_emulated
    forward, backward = emulated.ms_loss_forward.default, emulated.ms_loss_backward.default
    fused = ops.register_fused_op("ms_loss_cuda_emulated::ms_loss_forward", "ms_loss_cuda_emulated::ms_loss_backward",
                                  forward, backward)
    return forward, backward, fused


TRITON_MISSING = dict(condition=triton_kernels is None or (DEVICE == "cpu" and not triton_kernels.INTERPRETED),
                      reason="Triton missing, or no GPU and TRITON_INTERPRET=1 not set before the kernels were imported")


@pytest.fixture(params=[
    pytest.param("cpu", marks=pytest.mark.skipif(ops.LOAD_ERROR is not None, reason="needs the built extension")),
    pytest.param("triton", marks=pytest.mark.skipif(**TRITON_MISSING)),
    pytest.param("triton_chunked", marks=pytest.mark.skipif(**TRITON_MISSING)),
    pytest.param("cuda", marks=pytest.mark.skipif(
        DEVICE == "cpu" or api._unavailable_reason("cuda", torch.device(DEVICE)) is not None,
        reason="needs a GPU and the CUDA kernels built")),
    pytest.param("cuda_emulated", marks=pytest.mark.skipif(
        ops.LOAD_ERROR is not None or shutil.which("ninja") is None,
        reason="needs the built extension (its autograd path) and ninja to build the emulation")),
])
def target(request, monkeypatch):
    """triton: the triton backend with its fused backward; triton_chunked: with the chunked backward
    (weights to memory, cuBLAS for the second product; a GPU's default) at a budget of one tile row or
    column per chunk, so that every case runs several."""
    if request.param.startswith("triton"):
        monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "1e-6" if request.param == "triton_chunked" else "0")
        return Target(request.param, "triton", DEVICE, torch.ops.ms_loss_cuda.triton_forward.default,
                      torch.ops.ms_loss_cuda.triton_backward.default, request.param == "triton_chunked")
    if request.param == "cuda":
        return Target("cuda", "cuda", DEVICE, ops.forward_op, ops.backward_op)
    if request.param == "cpu":
        return Target("cpu", "cpu", "cpu", ops.forward_op, ops.backward_op)
    forward, backward, fused = request.getfixturevalue("emulated_cuda_ops")
    monkeypatch.setattr(ops, "fused_forward", fused)  # backend="cpu" now calls the emulated CUDA op
    return Target("cuda_emulated", "cpu", "cpu", forward, backward)


def check(target, kwargs, dtype, reduction="mean", rtol=None, **options):
    return check_against_reference(target.backend, kwargs, dtype, reduction, device=target.device,
                                   rtol=TOLERANCE[dtype] if rtol is None else rtol, **options)


def in_turn(values, *axes):
    """Every combination of `axes`, each with the next of `values` in turn: each value meets each
    target in several cases, for a fraction of the runs of every combination. (The fused ops never
    see the reduction, only the gradient it gives each anchor: one value for all of them from
    "mean" and "sum", a random vector from "none".)"""
    runs = []
    for i, combination in enumerate(itertools.product(*axes)):  # (a tuple on an axis: several parameters)
        flat = [v for value in combination for v in (value if isinstance(value, tuple) else (value,))]
        runs.append((*flat, values[i % len(values)]))
    return runs


REDUCTIONS = ["mean", "sum", "none"]


@pytest.mark.parametrize("case,mining,reduction",
                         in_turn(REDUCTIONS, ["self", "self_ids", "ref", "ref_ids", "ref_own_copy"], [True, False]))
def test_matches_reference(target, case, mining, reduction):
    # 97 rows and D = 130 leave partial row, column and K tiles, and split D over two programs
    ref_loss, ref_grads = check(target, build_case(case, 97, 130, torch.float32), torch.float32, reduction, mining=mining)
    assert ref_loss.abs().sum() > 0 and ref_grads[0].abs().sum() > 0  # the case is not trivial


@pytest.mark.parametrize("dtype,mining,reduction", in_turn(REDUCTIONS, [torch.float32, torch.float16], [True, False]))
def test_a_memory_bank_matches_reference(target, dtype, mining, reduction):
    # a bank that takes no gradient, holding the batch's own rows (skipped by identity) and 51 more:
    # 148 columns, several chunks in the chunked backward
    ref_loss, ref_grads = check(target, build_case("ref_own_copy", 97, 130, dtype), dtype, reduction, mining=mining,
                                ref_grad=False)
    assert len(ref_grads) == 1 and ref_grads[0].abs().sum() > 0


def chunk_choices(monkeypatch, triangle_rows=None):
    """[(chunks, triangle)] of every chunked backward plan made after this (`_chunk_rectangles`); with
    triangle_rows, the tile table's TRIANGLE_ROWS replaced by it (10 ** 9: whole rows; 1: the
    triangle at any chunk height, where a GPU's table asks for 1024 rows)."""
    kernels = triton_kernels.ms_loss
    shipped_rectangles, chosen = kernels._chunk_rectangles, []

    def rectangles(*args):
        chosen.append(shipped_rectangles(*args))
        return chosen[-1]

    if triangle_rows is not None:
        monkeypatch.setattr(kernels, "tile_config", kernels.with_triangle_rows(triangle_rows, kernels.tile_config))
    monkeypatch.setattr(kernels, "_chunk_rectangles", rectangles)
    return chosen


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("mining", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_chunked_self_case_in_whole_rows_matches_reference(monkeypatch, dtype, mining, reduction):
    """Chunks shorter than TRIANGLE_ROWS take whole rows (each row of dx written once, each row's own
    lift): several chunks of one tile row each, where the triton_chunked target runs the triangle."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "1e-6")  # (1 byte)
    chosen = chunk_choices(monkeypatch, triangle_rows=10 ** 9)
    target = Target("triton_chunked", "triton", DEVICE, torch.ops.ms_loss_cuda.triton_forward.default,
                    torch.ops.ms_loss_cuda.triton_backward.default, True)
    check(target, build_case("self", 200, 130, dtype), dtype, reduction, mining=mining)
    assert chosen and all(len(chunks) > 1 and not triangle for chunks, triangle in chosen)


def twin_classes_case(batch=97, dim=64, duplicates=10):
    """A self case whose hardest negatives sit next to the anchor in label order (classes 2k and 2k + 1
    have nearly the same centre), so inside a row block's positive range, and whose last rows are
    near-copies of the first under a distant label with the same identity (pairs to skip, which
    would be the hardest negatives of all)."""
    gen = torch.Generator().manual_seed(5)
    classes = batch // 4
    labels = torch.randint(0, classes, (batch,), generator=gen)
    centres = torch.randn(classes, dim, generator=gen, dtype=torch.float64)
    centres[1::2] = centres[0:-1:2] + 0.3 * torch.randn(classes // 2, dim, generator=gen, dtype=torch.float64)
    x = centres[labels] + 0.5 * torch.randn(batch, dim, generator=gen, dtype=torch.float64)
    ids = torch.arange(batch)
    copies = slice(batch - duplicates, batch)
    x[copies] = x[:duplicates] + 0.01 * torch.randn(duplicates, dim, generator=gen, dtype=torch.float64)
    labels[copies] = (labels[:duplicates] + classes // 2) % classes
    ids[copies] = ids[:duplicates]
    return dict(embeddings=x.float(), labels=labels, ids=ids)


@pytest.mark.skipif(triton_kernels is None, reason="Triton missing")
def test_identities_shared_across_labels_are_found():
    # (the flag that makes the self case's negatives kernel compare the caller's identities)
    shared = triton_kernels.ms_loss._shared_identities
    labels = torch.tensor([0, 0, 1, 1, 2], dtype=torch.int32)
    assert shared(torch.tensor([5, 6, 7, 8, 9], dtype=torch.int32), labels).tolist() == [0]  # distinct
    assert shared(torch.tensor([5, 5, 7, 7, 9], dtype=torch.int32), labels).tolist() == [0]  # within a label
    assert shared(torch.tensor([5, 6, 7, 5, 9], dtype=torch.int32), labels).tolist() == [1]  # labels 0 and 1
    assert shared(torch.tensor([9, 6, 7, 8, 9], dtype=torch.int32), labels).tolist() == [1]  # labels 0 and 2
    assert shared(torch.tensor([3], dtype=torch.int32), labels[:1]).tolist() == [0]


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("mining", [True, False])
def test_hard_negatives_in_the_positive_range_and_skipped_identities(target, mining, reduction):
    # (the self case's negatives kernel leaves each block's positive range to the positive kernels, and
    # compares identities only when the caller gives them; float32: the near-copies' similarities are too
    # steep under beta = 50 for 16-bit rounding to meet a tolerance)
    check(target, twin_classes_case(), torch.float32, reduction, mining=mining)


# (several row blocks and D split over two programs together: test_matches_reference's 97 x 130)
@pytest.mark.parametrize("batch,dim,mining",
                         in_turn([True, False], [(1, 3), (2, 3), (2, 64), (37, 3), (37, 130), (97, 64), (300, 3)]))
def test_sizes(target, batch, dim, mining):
    for case in ("self", "ref"):
        check(target, build_case(case, batch, dim, torch.float32, seed=batch), torch.float32, mining=mining)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
# D = 300: several column blocks of D; B = 300: several row blocks of the GPU's 16-bit tiles too
@pytest.mark.parametrize("case,batch,dim,mining",
                         in_turn([True, False], ["self", "ref_ids"], [(97, 130), (37, 300), (300, 64)]))
def test_16_bit_inputs(target, case, batch, dim, mining, dtype):
    kwargs = build_case(case, batch, dim, torch.float64, seed=5)
    for key in ("embeddings", "ref_embeddings"):  # unit rows, exactly representable in `dtype`
        if key in kwargs:
            kwargs[key] = F.normalize(kwargs[key], dim=1).to(dtype)
    check(target, kwargs, dtype, "none", normalize=False, mining=mining)


def test_mixed_input_dtypes(target):
    kwargs = build_case("ref", 37, 64, torch.float32, seed=6)
    kwargs["embeddings"] = F.normalize(kwargs["embeddings"], dim=1).half()
    check(target, kwargs, torch.float16, normalize=False)


def test_int32_keys_and_non_contiguous_inputs(target):
    kwargs = build_case("ref_ids", 97, 64, torch.float32, seed=9, labels_dtype=torch.int32)
    kwargs["ref_embeddings"] = kwargs["ref_embeddings"].T.contiguous().T  # column-major
    kwargs["ids"] = kwargs["ids"].to(torch.int32)
    check(target, kwargs, torch.float32, "sum")


def test_misaligned_rows_give_the_same_result(target):
    # (called on the ops: the public function would hand them a normalised, fresh copy)
    x, labels = make_batch(97, 64, 16, dtype=torch.float32)
    x, labels = F.normalize(x, dim=1).to(target.device), labels.to(target.device)
    shifted = torch.zeros(x.numel() + 1, device=target.device)[1:].view_as(x).copy_(x)  # 4 bytes off 16
    args = (labels, None, None, None, None, 2.0, 50.0, 0.5, 0.1, True, False)
    loss, stats = target.forward(x, *args)
    shifted_loss, shifted_stats = target.forward(shifted, *args)
    same = dict(rtol=1e-6, atol=1e-7)  # (Triton may compile another variant for an unaligned pointer)
    torch.testing.assert_close(shifted_loss, loss, **same)
    torch.testing.assert_close(shifted_stats, stats, **same)
    grad = target.backward(torch.ones_like(loss), stats, x, *args)[0]
    shifted_grad = target.backward(torch.ones_like(loss), stats, shifted, *args)[0]
    if target.chunked:  # (so may cuBLAS: small entries that cancel compare at the tensor's scale)
        assert_close(shifted_grad, grad, 1e-6)
    else:
        torch.testing.assert_close(shifted_grad, grad, **same)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_options(target, case, skip):
    kwargs = build_case(case, 61, 7, torch.float32, seed=3)
    kwargs["embeddings"] = F.normalize(kwargs["embeddings"], dim=1) * 0.9
    check(target, kwargs, torch.float32, "none", skip_incomplete_anchors=skip, normalize=False,
          alpha=3.0, beta=20.0, base=0.4, epsilon=0.05)


@pytest.mark.parametrize("mining", [True, False])
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("case", ["self", "ref"])
def test_anchors_without_negatives_or_positives(target, case, skip, mining):
    """Anchors with positives only (a one-class batch; in a reference set, the label of every column)
    and with negatives only (a label no column has): each end's terms alone, or with
    skip_incomplete_anchors nothing, also without mining, where having any pair of a set is what
    counts."""
    kwargs = build_case(case, 45, 8, torch.float32, seed=12)
    if case == "self":
        kwargs["labels"] = torch.zeros_like(kwargs["labels"])
    else:
        kwargs["labels"] = kwargs["labels"] % 2
        kwargs["ref_labels"] = torch.zeros_like(kwargs["ref_labels"])
    check(target, kwargs, torch.float32, "none", skip_incomplete_anchors=skip, mining=mining)


@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_negatives_far_below_base_under_a_steep_beta(target, case):
    """Classes on orthogonal directions (negatives at S ~ 0), base = 0.5, beta = 300, no mining: every
    negative's exponent beta (S - base) is about -150, below float32's range once exponentiated. The
    log-sum-exp must keep its shift at 0 there (log(1 + sum), the 1 being exp(-shift)), not at the
    largest exponent, which would make exp(-shift) overflow."""
    kwargs = build_case(case, 61, 16, torch.float32, seed=21)
    for key, label_key in (("embeddings", "labels"), ("ref_embeddings", "ref_labels")):
        if key in kwargs:  # tight clusters around the class's unit vector (at most 10 classes here)
            kwargs[key] = torch.eye(16)[kwargs[label_key]] + 0.05 * torch.randn(kwargs[key].shape,
                                                                          generator=torch.Generator().manual_seed(3))
    check(target, kwargs, torch.float32, "none", rtol=1e-4, mining=False, beta=300.0, base=0.5)


@pytest.mark.parametrize("mining", [True, False])
@pytest.mark.parametrize("case", ["self_ids", "ref_ids"])
def test_negatives_above_base_in_every_tile(target, case, mining):
    """Every row leans towards one shared direction, so that pairs of different classes reach S = 0.5
    to 0.95, above base: the negatives' exponents beta (S - base) are positive in every tile and their
    largest keeps rising along a column split (B = 300: under the interpreter the self case's launch
    has three splits of two tiles, the reference set's three of one). The online log-sum-exp must rescale what it summed before each new largest, and the
    splits' sums when it combines them; in the other tests the exponents mostly stay below 0, where
    the shift stays 0 and a missing rescale changes nothing (each was caught by one case of
    test_sizes alone)."""
    kwargs = build_case(case, 300, 16, torch.float32, seed=9)
    lean = F.normalize(torch.randn(16, generator=torch.Generator().manual_seed(2)), dim=0)
    for key in ("embeddings", "ref_embeddings"):
        if key in kwargs:
            kwargs[key] = F.normalize(kwargs[key], dim=1) + 2.0 * lean
    check(target, kwargs, torch.float32, "none", rtol=1e-4, mining=mining)


@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e25), (torch.float16, 5e3)])
def test_rows_whose_norm_overflows_their_dtype(target, dtype, scale):
    """Rows scaled far beyond unit norm normalise to the same rows: float16 rows of norm above 65504
    (a float16 norm is inf, the row 0), float32 rows whose squares overflow float32 (from about 1.8e19
    on; F.normalize makes them 0). The loss is that of the unscaled rows."""
    kwargs = build_case("ref_ids", 61, 130, torch.float64, seed=6)
    for key in ("embeddings", "ref_embeddings"):
        kwargs[key] = (kwargs[key] * scale).to(dtype)
    check(target, kwargs, dtype, "none")


@pytest.mark.parametrize("rows", [[8.0, -8.0, -10.0, -10.5], [10.0, 1.0, 0.5, 0.45]])
def test_empty_mined_sets_with_similarities_far_from_base(target, rows):
    """Rows left unnormalised, so S lies far from base: anchor 0 has a positive and two negatives but
    neither set survives mining. A log-sum-exp shift taken from a set with no members (alpha (base -
    minpos) = 129 in the first batch, beta (maxneg - base) = 225 in the second) makes exp(-shift)
    underflow and its LP or LN -inf; the shift of an empty mined set must be 0."""
    x = torch.tensor(rows).unsqueeze(1) * torch.tensor([[1.0, 0.0]])
    kwargs = dict(embeddings=x, labels=torch.tensor([0, 0, 1, 1]))
    check(target, kwargs, torch.float32, "none", normalize=False)


@pytest.mark.parametrize("ref_grad", [True, False])
def test_empty_reference_set_gives_zero(target, ref_grad):
    x, labels = make_batch(5, 3, 2, dtype=torch.float32)
    loss, grads = loss_and_grads(
        to(dict(embeddings=x, labels=labels, ref_embeddings=torch.zeros(0, 3), ref_labels=labels[:0]), target.device),
        target.backend, torch.ones_like, ref_grad)
    assert loss.item() == 0 and torch.equal(grads[0], torch.zeros_like(grads[0]))
    assert len(grads) == 1 + ref_grad and grads[-1].shape == ((0, 3) if ref_grad else (5, 3))


@pytest.mark.parametrize("with_ref", [False, True])
def test_an_empty_batch_gives_zero(target, with_ref):
    """B = 0 (a process whose share of a gathered batch is empty, say): loss 0, an empty gradient for
    the batch and a zero one for the reference set."""
    kwargs = dict(embeddings=torch.zeros(0, 3), labels=torch.zeros(0, dtype=torch.long))
    if with_ref:
        ref, ref_labels = make_batch(5, 3, 2, dtype=torch.float32)
        kwargs.update(ref_embeddings=ref, ref_labels=ref_labels)
    loss, grads = loss_and_grads(to(kwargs, target.device), target.backend, torch.ones_like, reduction="sum")
    assert loss.item() == 0 and grads[0].shape == (0, 3)
    if with_ref:
        assert grads[1].shape == (5, 3) and grads[1].abs().sum() == 0


def test_backward_is_bitwise_deterministic(target):
    for kwargs in (build_case("self", 300, 64, torch.float32, seed=8), build_case("ref_ids", 300, 64, torch.float32)):
        kwargs = to(kwargs, target.device)
        first = loss_and_grads(kwargs, target.backend, torch.ones_like)
        again = loss_and_grads(kwargs, target.backend, torch.ones_like)
        assert torch.equal(first[0], again[0])
        assert all(torch.equal(a, b) for a, b in zip(first[1], again[1]))


@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_opcheck(target, case):
    kwargs = to(build_case(case, 29, 16, torch.float32, seed=1), target.device)
    x = F.normalize(kwargs["embeddings"], dim=1).requires_grad_()
    ref = kwargs.get("ref_embeddings")
    ref = None if ref is None else F.normalize(ref, dim=1).requires_grad_()
    args = (x, kwargs["labels"], kwargs.get("ids"), ref, kwargs.get("ref_labels"), kwargs.get("ref_ids"),
            2.0, 50.0, 0.5, 0.1, True, False)
    torch.library.opcheck(target.forward, args)
    loss, stats = target.forward(*args)
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(target.backward, (torch.rand_like(loss), stats.detach()) + detached)


@pytest.mark.skipif(ops.LOAD_ERROR is not None, reason="compares with the built extension's CPU kernel")
@pytest.mark.parametrize("case", ["ref_ids", "separated"])
def test_saves_the_cpu_kernels_statistics(target, case):
    if target.name == "cpu":
        pytest.skip("the CPU kernel's statistics are what the others are compared with")
    if case == "separated":  # 16 classes at the corners of a simplex (cosine -1/15): every hardest negative is
        # below 0, so a padded column's S = 0 taken for a negative would show in maxneg
        gen = torch.Generator().manual_seed(4)  # (B = 300: a last tile far from some blocks' positive ranges)
        labels = torch.arange(300) % 16
        corners = F.pad(torch.eye(16) - 1 / 16, (0, 48))
        x = F.normalize(corners[labels] + 0.005 * torch.randn(300, 64, generator=gen), dim=1)
        ref, kwargs = None, dict(labels=labels, ids=None, ref_labels=None, ref_ids=None)
    else:
        kwargs = build_case("ref_ids", 97, 64, torch.float32, seed=4)
        x, ref = F.normalize(kwargs["embeddings"], dim=1), F.normalize(kwargs["ref_embeddings"], dim=1)
    args = (kwargs["labels"], kwargs["ids"], ref, kwargs["ref_labels"], kwargs["ref_ids"], 2.0, 50.0, 0.5, 0.1, True, False)
    on_device = [a.to(target.device) if isinstance(a, torch.Tensor) else a for a in args]
    _, stats = target.forward(x.to(target.device), *on_device)
    _, cpu_stats = torch.ops.ms_loss_cuda.ms_loss_forward(x, *args)  # (then the pair weights it keeps)
    saved = 2 if target.backend == "triton" and ref is None else 0  # (then its label order, checked below)
    assert stats.shape == (4 + saved, x.shape[0])
    torch.testing.assert_close(stats[:4].cpu(), cpu_stats[:4], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("labels_dtype", [torch.int64, torch.int32, torch.int16, torch.uint8, torch.uint16,
                                          torch.uint32, torch.uint64])
def test_the_triton_self_case_keeps_its_label_order_for_the_backward(labels_dtype):
    """The self case's forward sorts the labels once and keeps the order and the sorted labels' ranks
    in its stats' last two rows (int32 bits), which the backward reads instead of sorting again; for
    every integer dtype, from labels that are not contiguous (no warning either), with the same loss
    and gradient as int64 labels."""
    x, labels = make_batch(97, 16, 9, dtype=torch.float32)
    labels = torch.stack([labels * 37 + 5, labels], 1).to(labels_dtype)[:, 0]  # (not their own ranks; strided)
    x, labels = F.normalize(x, dim=1).to(DEVICE), labels.to(DEVICE)
    args = (None, None, None, None, 2.0, 50.0, 0.5, 0.1, True, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (torch warns about a strided searchsorted input)
        loss, stats = torch.ops.ms_loss_cuda.triton_forward(x, labels, *args)
        grad = torch.ops.ms_loss_cuda.triton_backward(torch.ones_like(loss), stats, x, labels, *args)[0]
    order, ranks = (row.cpu().long() for row in triton_kernels.ms_loss.saved_label_order(stats, 97))
    wide = labels.cpu().long()
    assert torch.equal(order, torch.sort(wide, stable=True).indices)
    assert torch.equal(ranks, torch.searchsorted(wide[order], wide[order]))  # equal exactly where the labels are
    loss64, stats64 = torch.ops.ms_loss_cuda.triton_forward(x, labels.long(), *args)
    assert torch.equal(loss, loss64) and torch.equal(stats, stats64)
    assert torch.equal(grad, torch.ops.ms_loss_cuda.triton_backward(torch.ones_like(loss), stats, x, wide.to(DEVICE),
                                                                    *args)[0])
    for wrong in (stats[:4], stats[:, :96]):
        with pytest.raises(ValueError, match="stats must be the triton forward's"):
            torch.ops.ms_loss_cuda.triton_backward(torch.ones_like(loss), wrong, x, labels, *args)


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("case", ["self", "ref"])
@pytest.mark.parametrize("chunk_mib", ["0", "1"])
def test_one_gradient_for_all_anchors_is_the_same_as_a_vector_of_them(monkeypatch, case, chunk_mib):
    """The triton backward takes an expanded grad_loss (stride 0: "mean" and "sum" of the eager loss)
    as one value, its norm worked out by the scales kernel (UNIFORM), and grad_divisor divides it there
    (the eager loss's "mean": grad_output / B, no op for it): the same gradients as from the vector
    of those values, fused and chunked, within a few float32 ulps (GPU divisions are approximate)."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", chunk_mib)
    kwargs = to(build_case(case, 53, 24, torch.float32, seed=2), DEVICE)
    x = F.normalize(kwargs["embeddings"], dim=1)
    ref = None if case == "self" else F.normalize(kwargs["ref_embeddings"], dim=1)
    keys = (kwargs["labels"], None, ref, kwargs.get("ref_labels"), None)
    hyper = (2.0, 50.0, 0.5, 0.1, True, False)
    loss, stats = torch.ops.ms_loss_cuda.triton_forward(x, *keys, *hyper)
    grad_output = torch.tensor(-0.37, device=DEVICE)
    backward = triton_kernels.ms_loss._backward_of_checked_inputs
    uniform = backward(grad_output.expand(53), stats, x, *keys, *hyper, grad_divisor=53)
    vector = backward((grad_output / 53).expand(53).contiguous(), stats, x, *keys, *hyper)
    for got, want in list(zip(uniform, vector))[:1 if ref is None else 2]:  # (the self case: no grad_ref)
        assert got.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("ref_grad", [False, True])
def test_an_eager_triton_loss_is_one_autograd_node(ref_grad):
    """Eager calls of the triton backend take the whole loss (normalisation, the loss op, reduction,
    finiteness check, cast) as one autograd node: its inputs' gradients accumulate directly, with no
    node of torch's between them (each costs the host its own launches; see the test above)."""
    kwargs = to(build_case("ref", 40, 16, torch.float16), DEVICE)
    x = kwargs["embeddings"].requires_grad_()
    ref = kwargs["ref_embeddings"].requires_grad_(ref_grad)
    loss = multi_similarity_loss(x, kwargs["labels"], ref_embeddings=ref, ref_labels=kwargs["ref_labels"],
                                 backend="triton")
    leaves = [next_function for next_function, _ in loss.grad_fn.next_functions if next_function is not None]
    assert [type(f).__name__ for f in leaves] == ["AccumulateGrad"] * (1 + ref_grad)
    assert leaves[0].variable is x and (not ref_grad or leaves[1].variable is ref)


@pytest.mark.skipif(**TRITON_MISSING)
def test_the_eager_loss_issues_its_backward_in_its_forward(monkeypatch):
    """"mean" and "sum" under grad mode: the eager forward launches the backward's kernels too (for
    grad_output 1), and the backward only scales their float32 result by grad_output: the same
    gradient as the backward of "none" weighted alike, twice alike under retain_graph (the kept
    gradient is not scaled in place). Without a gradient to take (no_grad, inputs that take none),
    or for "none", the forward launches the forward's kernels only."""
    kernels = []
    shipped = triton_kernels.ms_loss.Launch.__call__
    monkeypatch.setattr(triton_kernels.ms_loss.Launch, "__call__",
                        lambda launch: (kernels.append(launch.kernel.fn.__name__), shipped(launch)))
    kwargs = to(build_case("self", 45, 16, torch.float32, seed=4), DEVICE)
    x = kwargs["embeddings"].requires_grad_()

    def forward_kernels(x, reduction):
        kernels.clear()
        loss = multi_similarity_loss(x, kwargs["labels"], reduction=reduction, backend="triton")
        return loss, set(kernels)

    loss, launched = forward_kernels(x, "mean")
    assert "_scales_kernel" in launched and "_unit_rows_grad_kernel" in launched
    (first,) = torch.autograd.grad(loss, x, torch.tensor(-2.5, device=DEVICE), retain_graph=True)
    (again,) = torch.autograd.grad(loss, x, torch.tensor(-2.5, device=DEVICE))
    assert torch.equal(first, again)
    losses, launched = forward_kernels(x, "none")
    assert "_scales_kernel" not in launched
    (want,) = torch.autograd.grad(losses, x, torch.full_like(losses, -2.5 / 45))
    torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    with torch.no_grad():
        assert "_scales_kernel" not in forward_kernels(x, "sum")[1]
    assert "_scales_kernel" not in forward_kernels(x.detach(), "sum")[1]


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("chunk_mib", ["0", "1"])
def test_a_scaled_grad_output_keeps_the_small_entries_of_16_bit_gradients(monkeypatch, chunk_mib):
    """The eager "mean" computes its gradient in the forward for grad_output 1 and scales it in the
    backward: it must keep it in float32, or the small entries of a 16-bit "mean" gradient (about
    1/B) go subnormal before a loss scaler's factor (2^10 here) lifts them, and lose their bits. The
    same gradient as "none" with grad_output / B for each anchor, which the kernels take at that
    scale (fused with one column split, as at large B on a GPU, and chunked; no normalisation)."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", chunk_mib)
    monkeypatch.setattr(triton_kernels.ms_loss, "_multiprocessors", lambda device, interpret: 1)
    kwargs = to(build_case("self", 301, 16, torch.float32, seed=6), DEVICE)
    x = F.normalize(kwargs["embeddings"], dim=1).half().requires_grad_()
    scale, labels = 2.0 ** 10, kwargs["labels"]
    loss = multi_similarity_loss(x, labels, normalize=False, backend="triton")
    (got,) = torch.autograd.grad(loss, x, torch.tensor(scale, dtype=loss.dtype, device=DEVICE))
    losses = multi_similarity_loss(x, labels, normalize=False, reduction="none", backend="triton")
    (want,) = torch.autograd.grad(losses, x, torch.full_like(losses, scale / 301))
    assert (want.float().abs() < 6.1e-5 * scale).float().mean() > 0.01  # (entries below float16's normals at 1)
    torch.testing.assert_close(got, want, rtol=5e-3, atol=1e-6 * want.abs().max().item())


@pytest.mark.skipif(triton_kernels is None or DEVICE != "cpu" or not triton_kernels.INTERPRETED,
                    reason="runs the GPU's tiles under the interpreter (on a GPU every test does)")
# the fused backward ("0") and the chunked one in several chunks, in turn: each case and each tile
# table entry meets both (the interpreter's bfloat16 is wrong: no bfloat16 here)
@pytest.mark.parametrize("case,dtype,capability,chunk_mib",
                         in_turn(["0", "0.05"], ["self_ids", "ref_ids", "memory_bank"],
                                 [(torch.float16, (9, 0)), (torch.float16, (8, 0)), (torch.float32, (9, 0))]))
def test_the_gpu_tile_table_under_the_interpreter(monkeypatch, case, dtype, capability, chunk_mib):
    """The interpreter's own tiles are small (tile_config); here the kernels run on the tiles a GPU of
    that capability gets, at B = 300 (row blocks of 128 in the forward, whose reference-set positive
    lists take seven halvings to search; the range launch's 64 rows under the weights' 128; the self
    case's chunks in the triangle, on its own tiles, at any height)."""
    shipped = triton_kernels.ms_loss.tile_config
    monkeypatch.setattr(triton_kernels.ms_loss, "tile_config",
                        lambda kind, tile_dtype, dim, *_: shipped(kind, tile_dtype, dim, False, capability))
    chosen = chunk_choices(monkeypatch, triangle_rows=1)
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", chunk_mib)
    kwargs = build_case("ref_ids" if case == "memory_bank" else case, 300, 64, torch.float64, seed=14)
    for key in ("embeddings", "ref_embeddings"):  # unit rows, exactly representable in `dtype`
        if key in kwargs:
            kwargs[key] = F.normalize(kwargs[key], dim=1).to(dtype)
    check_against_reference("triton", kwargs, dtype, "none", device=DEVICE, rtol=TOLERANCE[dtype],
                            ref_grad=case != "memory_bank", normalize=False)
    assert all(triangle == (case == "self_ids") for _, triangle in chosen)


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("beta", [0.0, -1.0, float("nan"), 1e-45])  # (1e-45: 0 in float32)
def test_the_triton_ops_refuse_a_beta_that_is_not_positive(beta):
    # (the public API refuses it before; a direct call of the ops would sum exp(beta * -inf) = NaN)
    x, labels = make_batch(8, 4, 3, dtype=torch.float32)
    x, labels = x.to(DEVICE), labels.to(DEVICE)
    with pytest.raises(ValueError, match="beta must be > 0"):
        torch.ops.ms_loss_cuda.triton_forward(x, labels, None, None, None, None, 2.0, beta, 0.5, 0.1, True, False)
    _, stats = torch.ops.ms_loss_cuda.triton_forward(x, labels, None, None, None, None, 2.0, 50.0, 0.5, 0.1, True,
                                                     False)
    with pytest.raises(ValueError, match="beta must be > 0"):
        torch.ops.ms_loss_cuda.triton_backward(torch.ones(8, device=DEVICE), stats, x, labels, None, None, None, None,
                                               2.0, beta, 0.5, 0.1, True, False)


def test_float64_is_refused_with_a_clear_error(target):
    if target.name == "cpu":
        pytest.skip("the CPU kernel takes float64 (tests/test_cpu_kernel.py)")
    x, labels = make_batch(8, 4, 3)
    x, labels = x.to(target.device), labels.to(target.device)
    if target.backend != "cpu":  # (the emulation runs under the name of the cpu backend, which takes float64)
        with pytest.raises(RuntimeError, match=f"backend '{target.backend}' cannot run: .*bfloat16.*float64"):
            multi_similarity_loss(x, labels, backend=target.backend)
    with pytest.raises((TypeError, RuntimeError), match="float64"):  # the op itself refuses it too
        target.forward(x, labels, None, None, None, None, 2.0, 50.0, 0.5, 0.1, True, False)


@pytest.mark.skipif(triton_kernels is None or DEVICE != "cpu", reason="about the interpreter on a machine without GPU")
def test_triton_on_cpu_tensors_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(triton_kernels, "INTERPRETED", False)
    x, labels = make_batch(8, 4, 3, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="backend 'triton' cannot run: .*TRITON_INTERPRET=1"):
        multi_similarity_loss(x, labels, backend="triton")
    assert "triton" not in api.available_backends("cpu")


@pytest.mark.parametrize("choice", ["target", "auto"])
def test_torch_compile_fullgraph(target, choice):
    kwargs = to(build_case("ref_ids", 64, 32, torch.float32, seed=12), target.device)
    backend = target.backend if choice == "target" else "auto"
    compiled = torch.compile(multi_similarity_loss, backend="aot_eager", fullgraph=True)
    x = kwargs.pop("embeddings").requires_grad_()
    loss = compiled(x, backend=backend, **kwargs)
    (grad,) = torch.autograd.grad(loss, x)
    eager = multi_similarity_loss(x, backend=backend, **kwargs)
    (grad_eager,) = torch.autograd.grad(eager, x)
    torch.testing.assert_close(loss, eager)
    torch.testing.assert_close(grad, grad_eager)


def test_fake_tensors_take_the_op_and_its_fake_kernel(target):
    """Under torch's tracing modes (here fake tensors) the loss calls the op, whose fake kernels give
    the shapes; the eager path would launch the kernels on tensors without data."""
    x, labels = make_batch(37, 32, 5, dtype=torch.float32)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(x.to(target.device)).requires_grad_()
        loss = multi_similarity_loss(x, mode.from_tensor(labels.to(target.device)), backend=target.backend)
        loss.backward()
    assert isinstance(loss, FakeTensor) and loss.shape == () and x.grad.shape == (37, 32)


@pytest.mark.skipif(DEVICE == "cpu" or ops.LOAD_ERROR is not None, reason="needs a GPU and the CUDA kernels built")
def test_cuda_ops_refuse_tensors_on_another_device():
    x, labels = make_batch(16, 8, 3, dtype=torch.float32)
    hyper = (2.0, 50.0, 0.5, 0.1, True, False)
    with pytest.raises(RuntimeError, match="labels is on cpu"):
        ops.forward_op(x.cuda(), labels, None, None, None, None, *hyper)
    loss, stats = ops.forward_op(x.cuda(), labels.cuda(), None, None, None, None, *hyper)
    with pytest.raises(RuntimeError, match="stats is on cpu"):
        ops.backward_op(torch.ones_like(loss), stats.cpu(), x.cuda(), labels.cuda(), None, None, None, None, *hyper)


@pytest.mark.skipif(triton_kernels is None, reason="needs Triton")
@pytest.mark.parametrize("row_programs,num_cols,block_n", [(1, 1000, 64), (8, 1 << 20, 64), (300, 5000, 64),
                                                           (3, 0, 64), (2, 130, 64)])
def test_column_splits_cover_every_column_once(row_programs, num_cols, block_n):
    splits, per_split = triton_kernels.column_splits(row_programs, num_cols, block_n, 132)
    assert splits >= 1 and per_split % block_n == 0
    assert (splits - 1) * per_split < max(num_cols, 1) <= splits * per_split  # none empty, all covered
    if num_cols > 0:
        assert row_programs * splits >= min(2 * 132, row_programs * -(-num_cols // block_n))


@pytest.mark.skipif(triton_kernels is None, reason="needs Triton")
@pytest.mark.parametrize("batch,ref_rows,classes,block_m", [(257, 1000, 90, 128), (97, 5, 40, 32), (64, 3000, 2, 64),
                                                            (1, 7, 1, 64), (0, 5, 1, 64)])
def test_positive_lists_hold_exactly_each_blocks_labels(batch, ref_rows, classes, block_m):
    """positive_ranges' contract, walked slot by slot as _positive_columns does (a search for the slot's
    segment, then the shifted column order): each block's list is exactly the columns whose label one
    of its anchors has, each once."""
    gen = torch.Generator().manual_seed(batch)
    row_keys = torch.randint(0, classes, (batch,), generator=gen, dtype=torch.int32)
    col_keys = torch.randint(0, classes, (ref_rows,), generator=gen, dtype=torch.int32)
    row_order, col_order, segment_end, column_shift, ranges = triton_kernels.positive_ranges(row_keys, col_keys,
                                                                                             block_m)
    assert sorted(row_order.tolist()) == list(range(batch)) and ranges.shape == (-(-batch // block_m), 2)
    for k, (start, end) in enumerate(ranges.tolist()):
        anchors = row_order[k * block_m:(k + 1) * block_m].long()
        slots = torch.arange(start, end)
        owner = k * block_m + torch.searchsorted(segment_end[k * block_m:(k + 1) * block_m], slots, right=True)
        columns = col_order[(slots + column_shift[owner]).long()].long()
        wanted = torch.isin(col_keys, row_keys[anchors]).nonzero().flatten()
        assert sorted(columns.tolist()) == wanted.tolist()


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("one_kernel_sort", [4096, 32, 7])  # (one sort; rows of keys merged, some padded; too many rows)
@pytest.mark.parametrize("batch,classes,block_m,keys_dtype,rows_dtype", [
    (300, 70, 64, torch.int64, torch.float16), (97, 40, 32, torch.uint8, torch.float32),
    (130, 3, 64, torch.int16, torch.bfloat16), (257, 257, 128, torch.int32, None), (1, 1, 64, torch.int64, torch.float32),
    (0, 1, 64, torch.int64, torch.float16)])
def test_the_label_order_kernel_sorts_ranks_and_copies_the_rows(monkeypatch, one_kernel_sort, batch, classes, block_m,
                                                                keys_dtype, rows_dtype):
    """_label_order (a sort, then _label_order_kernel): the stable order, the keys' ranks in the caller's
    order and their first positions in the sorted one (saved), each block's positive range (exactly the
    columns of its labels, each once) and the rows and identities in that order, bit for bit; int64
    keys equal in their low 32 bits stay apart, uint8 keys of 255 beside the padding's 255. Sorted
    whole, or as rows of one_kernel_sort keys that the kernel merges (at most 16 rows)."""
    monkeypatch.setattr(triton_kernels.ms_loss, "ONE_KERNEL_SORT", one_kernel_sort)
    gen = torch.Generator().manual_seed(batch)
    keys = torch.randint(0, classes, (batch,), generator=gen)
    if keys_dtype == torch.int64:
        keys = keys * 2**33 - 7
    if keys_dtype == torch.uint8:
        keys = keys + 255 - classes + 1  # (the largest keys are 255)
    keys = keys.to(keys_dtype).to(DEVICE)
    rows = None if rows_dtype is None else torch.randn(batch, 37, generator=gen).to(rows_dtype).to(DEVICE)
    ids = torch.randperm(batch, generator=gen).to(torch.int32).to(DEVICE)
    saved = torch.full((2, batch), -1, dtype=torch.int32, device=DEVICE)
    in_order = triton_kernels.ms_loss._label_order(keys, block_m, saved, rows, ids)
    triton_kernels.ms_loss._launch([in_order.launch])
    wide = keys.cpu().long()
    order, first, ranks, ranges = label_order_by_torch(wide, block_m)
    assert torch.equal(in_order.order.cpu().long(), order) and torch.equal(saved[0].cpu().long(), order)
    assert torch.equal(saved[1].cpu().long(), first) and torch.equal(in_order.ranks.cpu().long(), ranks)
    assert torch.equal(in_order.ids, ids[order.to(DEVICE)])
    if rows is not None:
        assert torch.equal(in_order.rows, rows[order.to(DEVICE)])
    assert torch.equal(in_order.ranges.cpu().long(), ranges.reshape(-1, 2))
    for k, (start, end) in enumerate(in_order.ranges.tolist()):
        wanted = torch.isin(wide, wide[order[k * block_m:(k + 1) * block_m]]).nonzero().flatten()
        assert sorted(order[start:end].tolist()) == wanted.tolist()


@pytest.mark.skipif(DEVICE == "cpu" or triton_kernels is None, reason="GPU sizes (the interpreter: minutes)")
@pytest.mark.parametrize("batch", [16384, 65536, 16383])
def test_the_merged_sort_gives_one_sorts_step_at_gpu_sizes(monkeypatch, batch):
    """An eager float16 step whose labels are sorted as rows of 4096 and merged by _label_order_kernel
    (4, 16 and 4 padded rows) has the loss, gradient and statistics of the same step after one
    global sort, bit for bit (first run on an H100, 2026-11-26, as a script)."""
    x, labels = make_batch(batch, 64, batch // 4, dtype=torch.float16)
    x, labels = x.to(DEVICE), labels.to(DEVICE)
    results = []
    for one_kernel_sort in (4096, 10 ** 9):
        monkeypatch.setattr(triton_kernels.ms_loss, "ONE_KERNEL_SORT", one_kernel_sort)
        embeddings = x.clone().requires_grad_()
        loss = multi_similarity_loss(embeddings, labels, backend="triton")
        loss.backward()
        stats = torch.ops.ms_loss_cuda.triton_forward(x, labels, None, None, None, None, 2.0, 50.0, 0.5, 0.1,
                                                      True, False)[1]
        results.append((loss, embeddings.grad, stats))
    assert all(torch.equal(merged, whole) for merged, whole in zip(*results))


@pytest.mark.parametrize("case", ["self", "ref"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 3e38])
@pytest.mark.parametrize("normalize", [True, False])
def test_non_finite_embeddings_give_nan_and_huge_finite_ones_do_not(target, case, bad, normalize):
    """NaN or an infinity in the embeddings (or the reference set) makes the loss NaN, every reduction,
    whether the eager triton loss takes its gradients in the forward or not (which finds them, with
    normalisation, in its row kernel); a finite 3e38 (float32's squares overflow) does not."""
    if bad == 3e38 and not normalize:
        pytest.skip("unnormalised, a similarity of 3e38 squared overflows")
    x, labels = make_batch(12, 4, 3, dtype=torch.float32)
    ref, ref_labels = make_batch(9, 4, 3, dtype=torch.float32, seed=1) if case == "ref" else (None, None)
    (x if case == "self" else ref)[3, 1] = bad
    bank = {} if ref is None else dict(ref_embeddings=ref.to(target.device), ref_labels=ref_labels.to(target.device))
    for reduction, requires_grad in (("mean", True), ("sum", False), ("none", True)):
        embeddings = x.to(target.device).requires_grad_(requires_grad)
        loss = multi_similarity_loss(embeddings, labels.to(target.device), backend=target.backend,
                                     normalize=normalize, reduction=reduction, **bank)
        assert (torch.isfinite(loss) if bad == 3e38 else torch.isnan(loss)).all(), (reduction, loss)


def test_int64_keys_beyond_the_int32_range(target):
    # Keys equal in their low 32 bits: a kernel that truncated them would merge every class.
    kwargs = build_case("ref_ids", 61, 16, torch.float32, seed=13)
    for key in ("labels", "ref_labels", "ids", "ref_ids"):
        kwargs[key] = kwargs[key] * 2**33 - 7
    check(target, kwargs, torch.float32, "none")


def test_a_bank_that_takes_no_gradient_gets_none(target):
    # ref_grad=False (what autograd asks for when the reference set does not require a gradient, as a
    # memory bank does not): the same dx (bit for bit from the same fused launch; the chunked form
    # sums it over chunks whose size depends on ref_grad), and an empty dref.
    kwargs = to(build_case("ref_ids", 61, 16, torch.float32, seed=14), target.device)
    x, ref = F.normalize(kwargs["embeddings"], dim=1), F.normalize(kwargs["ref_embeddings"], dim=1)
    args = (kwargs["labels"], kwargs["ids"], ref, kwargs["ref_labels"], kwargs["ref_ids"], 2.0, 50.0, 0.5, 0.1, True,
            False)
    loss, stats = target.forward(x, *args)
    grad = torch.randn(loss.shape, generator=torch.Generator().manual_seed(3)).to(loss.device)
    full = target.backward(grad, stats, x, *args)
    bank = target.backward(grad, stats, x, *args, False)
    assert bank[1].numel() == 0 and full[1].shape == ref.shape
    if target.chunked:
        assert_close(bank[0], full[0], 1e-6)
    else:
        assert torch.equal(bank[0], full[0])
    torch.library.opcheck(target.backward, (grad, stats, x, *args, False))
    # through autograd, against the float64 reference
    x = kwargs["embeddings"].clone().requires_grad_()
    options = {k: kwargs[k] for k in ("labels", "ids", "ref_embeddings", "ref_labels", "ref_ids")}
    multi_similarity_loss(x, backend=target.backend, **options).backward()
    expected = kwargs["embeddings"].cpu().double().requires_grad_()
    multi_similarity_loss(expected, backend="reference", **to(options, "cpu", torch.float64)).backward()
    assert_close(x.grad, expected.grad, TOLERANCE[torch.float32])


def test_the_ops_refuse_keys_of_the_wrong_length(target):
    # (the public API checks this first; the ops check again for direct calls)
    x, labels = make_batch(16, 8, 3, dtype=torch.float32)
    x, labels = F.normalize(x, dim=1).to(target.device), labels.to(target.device)
    with pytest.raises((ValueError, RuntimeError), match="labels"):
        target.forward(x, labels[:-1], None, None, None, None, 2.0, 50.0, 0.5, 0.1, True, False)


def test_float16_weights_keep_their_precision_row_by_row(target):
    """No mining against 1,500 rows makes every pair weight about 1/1500, and grad_outputs from 1e4
    down to 1 (scaled by the largest: 1 ... 1e-4) shrink some rows' weights to about 7e-8, a single
    float16 subnormal step, without each row's own lift. Every row of dx is compared with the
    float64 reference at its own scale, not only at the tensor's largest (with every lift set to 1,
    each backend's worst row is 5.5e-2 off). A reference set: in the self case a row of dx also
    sums the other anchors' weights of its column, which outweigh its own here (1500 anchors passed
    this test with the Triton kernels' lifts set to 1)."""
    gen = torch.Generator().manual_seed(17)
    batch, rows = 12, 1500
    x = F.normalize(torch.randn(batch, 64, generator=gen, dtype=torch.float64), dim=1).half()
    kwargs = dict(embeddings=x, labels=torch.arange(batch) % 3, ids=torch.arange(batch),
                  ref_embeddings=F.normalize(torch.randn(rows, 64, generator=gen, dtype=torch.float64), dim=1).half(),
                  ref_labels=torch.randint(0, 40, (rows,), generator=gen), ref_ids=torch.arange(batch, batch + rows))
    spread = torch.logspace(4, 0, batch, dtype=torch.float64)  # every row's gradient a normal float16
    grad_output = lambda loss: spread.to(loss.device, loss.dtype)  # noqa: E731
    options = dict(reduction="none", mining=False, normalize=False, beta=10.0)
    dx = loss_and_grads(to(kwargs, target.device), target.backend, grad_output, **options)[1][0]
    want = loss_and_grads(to(kwargs, "cpu", torch.float64), "reference", grad_output, **options)[1][0]
    dx, want = dx.double().cpu(), want.double()
    error = (dx - want).abs().amax(dim=1) / want.abs().amax(dim=1)
    assert error.max() < 4e-3, f"worst row {error.argmax().item()}: {error.max().item():.2e} of its own scale"


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("chunk_mib", ["0", "1e-6"])  # the fused backward; the chunked one, the self case's triangle
def test_float16_weights_keep_their_precision_under_a_tiny_grad_output(monkeypatch, chunk_mib):
    """grad_output 1e-6 for every anchor: the lifts must take each row's float16 weights (about 1/200)
    back towards 1, whatever the grad_output's scale (in the triangle each weight takes both its
    anchors' lifts). Compared before the gradient is rounded to float16 (where 1e-6 x S would be
    subnormal): the backward plan's float32 dx against the float64 reference."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", chunk_mib)
    gen = torch.Generator().manual_seed(17)
    x = F.normalize(torch.randn(200, 64, generator=gen, dtype=torch.float64), dim=1).half()
    labels = torch.randint(0, 40, (200,), generator=gen)
    hyper = (2.0, 10.0, 0.5, 0.1, False, False)  # (alpha, beta, base, epsilon, mining, skip_incomplete_anchors)
    kernels, on_device = triton_kernels.ms_loss, (x.to(DEVICE), labels.to(DEVICE), None, None, None, None)
    _, stats = kernels._run(kernels.forward_plan, on_device[0].device, *on_device, *hyper)
    grad_output = torch.full((200,), 1e-6, dtype=torch.float32, device=DEVICE)
    dx = kernels._run(kernels.backward_plan, grad_output.device, grad_output, stats, *on_device, *hyper)[0]
    dx = dx.sum(0) if dx.dim() == 3 else dx  # (split partials)
    want = loss_and_grads(dict(embeddings=x.double(), labels=labels), "reference",
                          lambda loss: torch.full_like(loss, 1e-6), reduction="none", mining=False, normalize=False,
                          beta=10.0)[1][0]
    assert_close(dx[:, :64], want, 4e-3, min_scale=0.0)


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("form", ["fused", "whole_rows", "triangle"])
def test_float16_weights_of_a_group_with_tiny_grad_outputs_keep_their_precision(monkeypatch, form):
    """The self case's lifts: two groups of 100 anchors in orthogonal halves of the embedding (pairs
    across them weigh about e^-25 under beta = 50), the second's grad_output 2^-17 of the first's,
    so its rows of dx come from its own weights alone, in float16 subnormals unless lifted. With
    each row's lift every row holds 1.5e-3 of its own scale (every lift set to 1: 0.4; the
    triangle's former one lift for all rows: 3.5e-2). The fused backward, and the chunked one in
    chunks of whole rows and in the triangle (a GPU's choice for 16-bit batches whose weights need
    several chunks: B above about 11,600 at the default 256 MiB), whose weights take both ends' lifts."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "0" if form == "fused" else "1e-6")
    kernels = triton_kernels.ms_loss
    chosen = chunk_choices(monkeypatch, {"fused": None, "whole_rows": 10 ** 9, "triangle": 1}[form])
    gen, n = torch.Generator().manual_seed(3), 100
    x = torch.zeros(2 * n, 64, dtype=torch.float64)
    for group, columns in enumerate((slice(0, 32), slice(32, 64))):  # each around a centre of its own
        x[group * n:(group + 1) * n, columns] = (torch.randn(1, 32, generator=gen, dtype=torch.float64)
                                                 + 0.2 * torch.randn(n, 32, generator=gen, dtype=torch.float64))
    x = F.normalize(x, dim=1).half()
    labels = torch.cat([torch.randint(0, 10, (n,), generator=gen), torch.randint(10, 20, (n,), generator=gen)])
    grad_output = torch.cat([torch.ones(n), torch.full((n,), 2.0 ** -17)])
    hyper = (2.0, 50.0, 0.5, 0.1, False, False)  # (alpha, beta, base, epsilon, mining, skip_incomplete_anchors)
    on_device = (x.to(DEVICE), labels.to(DEVICE), None, None, None, None)
    _, stats = kernels._run(kernels.forward_plan, on_device[0].device, *on_device, *hyper)
    dx = kernels._run(kernels.backward_plan, on_device[0].device, grad_output.to(DEVICE), stats, *on_device, *hyper)[0]
    dx = (dx.sum(0) if dx.dim() == 3 else dx)[:, :64].double().cpu()  # (split partials; float32, before rounding)
    want = loss_and_grads(dict(embeddings=x.double(), labels=labels), "reference", lambda loss: grad_output.double(),
                          reduction="none", mining=False, normalize=False, beta=50.0)[1][0]
    error = (dx - want).abs().amax(dim=1) / want.abs().amax(dim=1)
    assert error.max() < 4e-3, f"worst row {error.argmax().item()}: {error.max().item():.2e} of its own scale"
    assert [triangle for _, triangle in chosen] == ([] if form == "fused" else [form == "triangle"])


@pytest.mark.skipif(triton_kernels is None, reason="needs Triton")
def test_float32_products_follow_torchs_matmul_precision():
    """IEEE products under "highest" (torch's default), TF32 tensor cores under "high"/"medium"."""
    before = torch.get_float32_matmul_precision()
    try:
        for precision, expected in (("highest", "ieee"), ("high", "tf32"), ("medium", "tf32")):
            torch.set_float32_matmul_precision(precision)
            for kind in ("forward", "backward"):
                assert triton_kernels.tile_config(kind, torch.float32, 512, interpret=False)["PRECISION"] == expected
            assert triton_kernels.tile_config("forward", torch.float16, 512, interpret=False)["PRECISION"] == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.skipif(DEVICE == "cpu" or triton_kernels is None, reason="TF32 needs a GPU (the interpreter computes IEEE)")
@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_triton_float32_under_tf32(case):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        check_against_reference("triton", build_case(case, 97, 130, torch.float32), torch.float32, "none",
                                device=DEVICE, rtol=3e-3)
    finally:
        torch.set_float32_matmul_precision(before)


def test_a_reference_set_that_is_the_batch_tensor_itself(target):
    """ref_embeddings=x (the same tensor) with other labels is a reference set, not the self case:
    its positives are found among the columns of its own labels."""
    x, labels = make_batch(97, 32, 12, dtype=torch.float32, seed=31)
    x = F.normalize(x, dim=1).to(target.device)
    ref_labels = torch.randint(0, 12, (97,), generator=torch.Generator().manual_seed(3)).to(target.device)
    labels = labels.to(target.device)
    got = multi_similarity_loss(x, labels, ref_embeddings=x, ref_labels=ref_labels, normalize=False,
                                reduction="none", backend=target.backend)
    want = multi_similarity_loss(x.double().cpu(), labels.cpu(), ref_embeddings=x.double().cpu(),
                                 ref_labels=ref_labels.cpu(), normalize=False, reduction="none", backend="reference")
    assert_close(got, want, TOLERANCE[torch.float32])


@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_steep_weights_and_zero_grad_outputs_stay_finite(target, case):
    """beta = 300 makes exp(beta (maxneg - base)) overflow float32 for anchors whose sets are empty;
    with some grad_outputs 0 the per-row lift must still be finite (it was NaN: 0 * inf)."""
    kwargs = build_case(case, 61, 16, torch.float32, seed=33)
    gen = torch.Generator().manual_seed(4)
    zeros = (torch.rand(61, generator=gen) < 0.5).double()
    grad_output = lambda loss: (zeros * torch.rand(61, generator=gen, dtype=torch.float64)).to(loss.device, loss.dtype)  # noqa: E731
    options = dict(reduction="none", beta=300.0, base=0.2)
    _, grads = loss_and_grads(to(kwargs, target.device), target.backend, grad_output, **options)
    gen.manual_seed(4)
    zeros = (torch.rand(61, generator=gen) < 0.5).double()
    _, want = loss_and_grads(to(kwargs, "cpu", torch.float64), "reference", grad_output, **options)
    for got, expected in zip(grads, want):
        assert torch.isfinite(got).all()
        assert_close(got, expected, 1e-4)


@pytest.mark.parametrize("case", ["self", "self_ids", "ref_ids"])
def test_a_negative_base_without_mining_keeps_padding_columns_out(target, case):
    """base = -1, beta = 100, no mining: a column past the batch's end (150 rows: tiles of 64 or 32
    leave some) has S = 0, where exp(beta (0 - base)) overflows float32. A tile must mask such columns
    before its exponentials, or 0 x inf = NaN reaches the gradient (in the self case's backward, the
    label-free tiles beside a row block's positive range have no classes that would mask them)."""
    kwargs = build_case(case, 150, 16, torch.float32, seed=8)
    check(target, kwargs, torch.float32, "sum", rtol=1e-4, mining=False, beta=100.0, base=-1.0)


class _TensorOps(TorchDispatchMode):
    """Records the torch ops that do work (views and dtype queries aside) of the code run under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func is torch.ops.aten.promote_types.default):
            self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 130), (5, 1000), (3, 1), (0, 4)])
def test_the_triton_normalisation_matches_torchs(dtype, shape):
    """triton_kernels.unit_rows (the triton backend's eager normalisation; D = 1000 in two blocks of
    columns) against torch's ops in float64, on a non-contiguous input: the rows and their gradient,
    a zero row and one of norm 1e-14 in float32 (the clamp at 1e-12; in 16-bit the gradient there,
    g / 1e-12, overflows as torch's does). With create_graph=True the same gradient, and a second
    derivative raises (the kernel's backward has none) rather than leave its share out."""
    gen = torch.Generator().manual_seed(5)
    t = torch.randn(shape[::-1], generator=gen, dtype=torch.float64).t()
    if dtype == torch.float32 and shape[0] >= 3:
        t[1], t[2] = 0.0, t[2] / t[2].norm() * 1e-14
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    x = t.to(DEVICE, dtype).requires_grad_()
    y = triton_kernels.unit_rows(x)
    (dx,) = torch.autograd.grad(y, x, g.to(DEVICE, dtype), retain_graph=True)
    t64 = t.clone().requires_grad_()
    (dx64,) = torch.autograd.grad(api.unit_rows(t64), t64, g)
    assert y.dtype == dx.dtype == dtype and y.shape == dx.shape == shape
    assert_close(y, api.unit_rows(t), TOLERANCE[dtype])
    assert_close(dx, dx64, TOLERANCE[dtype])
    (graphed,) = torch.autograd.grad(y, x, g.to(DEVICE, dtype), create_graph=True)
    assert torch.equal(graphed, dx)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(graphed.square().sum(), x)


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("case,rows,most", [("self", 3, 29), ("memory_bank", 4, 49)])
def test_an_eager_triton_step_issues_few_torch_ops(monkeypatch, case, rows, most):
    """On a GPU each torch op is a launch that costs the host several microseconds, and at B = 4096 the
    host's time was the whole step (bench/results/gpu/host-time-float16.txt). One eager forward and
    backward (normalised 16-bit rows, "mean") issues the loss's 5 kernel launches (6 in the self
    case), `rows` of the row kernels (the batch's normalisation forward and backward, the gradient's
    scaling by grad_output, the bank's normalisation) and at most `most` other ops,
    as many as today's build (71 and 80 before the trim; then 1 more in the self case for the
    label-ordered copy of the anchors that its negatives kernel reads and 13 to put its backward in
    label order: a sort, the ranges, four gathers; 69 and 77 before the row kernels took the place of
    torch's normalisation, 4 ops forward and 10 backward; 58 and 64 before the blocks' first and last
    keys came from views instead of gathers; 52 and 58 before the self case sorted its labels once
    for both ops (the backward reads the order from the forward's stats), found its blocks' ranges
    from the sorted ranks and the finiteness check added the extremes times 0; 40 and 54 before the
    eager call became one autograd node, whose backward takes "mean" as one gradient into the scales
    kernel and hands the normalisation's backward the float32 gradient as it is; 2 more since the
    forward issues the backward's launches and the backward scales their result: an empty_like and a
    mul; 3 fewer in the self case since its label order after the sort is one more launch,
    _label_order_kernel; 29 and 49 since the eager backward reads the forward's label-ordered rows, the
    normalisation finds non-finite rows as it reads them (a sum and an add where the extremes of
    each input took three ops) and the scaling by grad_output is a row kernel: the kernels are
    stubbed out, but for _label_order_kernel, whose order the backward's plan reads: this counts
    the host's work of a step after the first). The fused backward (a GPU's default, the chunked one, issues more: its cuBLAS products
    and buffers)."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "0")
    launched, kernels = [], triton_kernels.ms_loss
    launch = kernels.Launch.__call__

    def stub(self):
        launched.append(self.kernel)
        if self.kernel is kernels._label_order_kernel:  # (it runs, uncounted: the backward's plan reads its order)
            with _disable_current_modes():
                launch(self)

    monkeypatch.setattr(kernels.Launch, "__call__", stub)
    x, labels = make_batch(97, 128, 12, dtype=torch.float16)
    x, labels = x.to(DEVICE).requires_grad_(), labels.to(DEVICE)
    bank = {}
    if case == "memory_bank":  # no gradient for the bank
        ref, ref_labels = make_batch(300, 128, 12, dtype=torch.float16, seed=1)
        bank = dict(ref_embeddings=ref.to(DEVICE), ref_labels=ref_labels.to(DEVICE))
    multi_similarity_loss(x, labels, backend="triton", **bank).backward()  # (a first call makes what steps reuse)
    launched.clear()
    x.grad = None
    with _TensorOps() as tensor_ops:
        multi_similarity_loss(x, labels, backend="triton", **bank).backward()
    assert len(launched) == 5 + (case == "self") + rows
    assert len(tensor_ops.names) <= most, " ".join(tensor_ops.names)
