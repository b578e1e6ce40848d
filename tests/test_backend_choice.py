"""How a call's backend is chosen: what `available_backends` lists, explicit requests that cannot run,
"auto" on each device and dtype (and under $MS_LOSS_BACKEND, torch.func's transforms and meta tensors),
and the reasons a backend gives for not running (a missing module or dependency, a GPU or a Triton or
torch too old)."""
import pytest
import torch

import ms_loss_cuda
from ms_loss_cuda import available_backends, multi_similarity_loss

from conftest import make_batch


def test_available_backends_and_explicit_requests():
    assert "reference" in available_backends()
    x, labels = make_batch(8, 4, 3)
    for backend in ("cuda", "triton"):
        if backend not in available_backends():
            with pytest.raises(RuntimeError, match=f"backend '{backend}' cannot run: .+"):
                multi_similarity_loss(x, labels, backend=backend)


def test_no_fused_gpu_backend_is_listed_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert available_backends("cuda") == ["reference"]


def test_a_reference_set_of_another_dtype_picks_the_backend_of_their_common_dtype():
    """float32 anchors against a float64 reference set compute in float64: a backend that takes no float64
    is refused for the pair, naming the promoted dtype (on a GPU "auto" then takes the reference)."""
    x, labels = make_batch(12, 4, 3, dtype=torch.float32)
    ref, ref_labels = make_batch(9, 4, 3, dtype=torch.float64, seed=1)
    expected = multi_similarity_loss(x.double(), labels, ref_embeddings=ref, ref_labels=ref_labels,
                                     backend="reference")
    got = multi_similarity_loss(x, labels, ref_embeddings=ref, ref_labels=ref_labels)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected.float())
    with pytest.raises(RuntimeError, match="backend 'triton' cannot run: .*got torch.float64 .*promote"):
        multi_similarity_loss(x, labels, ref_embeddings=ref, ref_labels=ref_labels, backend="triton")


def test_a_missing_part_of_the_package_is_told_from_a_missing_dependency():
    """A backend module of the package itself that is missing (a clone's source folder, imported in place of
    the install) is said to be so, with the way out; a missing dependency is named for installing."""
    from ms_loss_cuda.backends import LazyBackend

    own = LazyBackend("x", "ms_loss_cuda.no_such_backend", ("cuda",), (torch.float16,), "triton").load()
    reason = own.unavailable_reason(torch.device("cpu"))
    assert reason.startswith("ms_loss_cuda.no_such_backend is missing (ms_loss_cuda was imported from the source")
    # (the module's import fails on another module: the dependency)
    dependency = LazyBackend("x", "no_such_dependency.kernels", ("cuda",), (torch.float16,), "no_such_dependency")
    assert dependency.load().unavailable_reason(torch.device("cpu")).endswith("; install no_such_dependency")


def test_meta_tensors_give_shapes_through_the_reference():
    """Shape inference on the meta device: "auto" takes the reference there, which has no autocast to leave."""
    x = torch.randn(8, 4, device="meta", requires_grad=True)
    labels = torch.arange(8, device="meta") % 2
    for reduction, shape in (("mean", ()), ("none", (8,))):
        loss = multi_similarity_loss(x, labels, reduction=reduction)
        assert loss.device.type == "meta" and loss.shape == shape and loss.dtype == torch.float32
    loss.sum().backward()
    assert x.grad.device.type == "meta" and x.grad.shape == (8, 4)


def test_environment_overrides_auto(monkeypatch):
    x, labels = make_batch(8, 4, 3)
    monkeypatch.setenv("MS_LOSS_BACKEND", "no-such-backend")
    with pytest.raises(ValueError, match="MS_LOSS_BACKEND"):
        multi_similarity_loss(x, labels)
    monkeypatch.setenv("MS_LOSS_BACKEND", "reference")
    calls = []
    monkeypatch.setattr(ms_loss_cuda.reference, "multi_similarity_loss",
                        lambda *a, **k: calls.append(1) or torch.zeros(8, dtype=torch.float64))
    multi_similarity_loss(x, labels)
    assert calls == [1]


def test_torch_func_transforms_take_the_reference_or_refuse_a_fused_backend():
    """Under torch.func.grad "auto" takes the reference, whose gradient autograd's matches; a fused
    backend named outright says why it cannot run there."""
    x, labels = make_batch(12, 4, 3)
    x = x.double()
    expected = torch.autograd.grad(multi_similarity_loss(x.requires_grad_(), labels), x)[0]
    torch.testing.assert_close(torch.func.grad(lambda t: multi_similarity_loss(t, labels))(x.detach()), expected)
    for backend in [b for b in ("cpu", "triton") if b in available_backends("cpu")]:
        with pytest.raises(RuntimeError, match=f"backend '{backend}' cannot run under torch.func's transforms"):
            torch.func.grad(lambda t: multi_similarity_loss(t, labels, backend=backend))(x.detach())


def test_auto_on_cuda_tensors_prefers_the_measured_faster_backend(monkeypatch):
    from ms_loss_cuda import backends

    reasons = {"cuda": None, "triton": None, "cpu": "CPU tensors only"}
    for name in reasons:
        monkeypatch.setattr(backends.get(name), "unavailable_reason",
                            lambda device, dtype=None, name=name: reasons[name])
    cuda = torch.device("cuda")

    def auto(dtype):
        return backends.resolve("auto", cuda, dtype).name

    assert auto(torch.float16) == auto(torch.bfloat16) == auto(torch.float32) == "triton"
    reasons["triton"] = "no triton"
    assert auto(torch.float16) == auto(torch.float32) == "cuda"
    reasons.update(cuda="not built", triton=None)
    assert auto(torch.float32) == "triton"
    reasons.update(triton="no triton")
    monkeypatch.setattr(backends, "_warned_fallback", False)
    with pytest.warns(UserWarning, match=r"dense reference backend \(triton: no triton; cuda: not built\)"):
        assert auto(torch.float16) == "reference"
    assert auto(torch.float64) == "reference"


def test_triton_needs_a_gpu_of_compute_capability_8(monkeypatch):
    """Triton supports GPUs of compute capability 8.0 and up; below (V100, T4) its 16-bit kernels
    compile without tensor-core instructions and spill, so "auto" must not pick it there."""
    pytest.importorskip("triton")
    from ms_loss_cuda import backends
    from ms_loss_cuda.triton_kernels import launcher

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = torch.device("cuda")
    for capability, reason in (((7, 5), "compute capability 8.0 or newer"), ((8, 6), None), ((12, 0), None)):
        monkeypatch.setattr(launcher, "device_capability", lambda device: capability)  # (the GPU's, asked once)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            got = backends.get("triton").unavailable_reason(cuda, dtype)
            assert got is None if reason is None else reason in got


def test_triton_names_the_versions_it_needs(monkeypatch):
    """Below Triton 3.4 (no triton.knobs, which the direct launches read), and on a GPU below torch 2.8
    (no float32-result 16-bit products for the chunked backward), the backend says so, so that "auto"
    takes another one instead of failing at the first launch."""
    pytest.importorskip("triton")
    import types

    import triton

    from ms_loss_cuda import backends
    from ms_loss_cuda.triton_kernels import launcher

    assert (launcher.TRITON_TOO_OLD, launcher.TORCH_TOO_OLD) == (None, None)  # (the pinned versions)
    old = launcher.version_needs(types.SimpleNamespace(__version__="3.3.1"), "2.7.1", ["default", "out"])
    assert old == ("it needs Triton 3.4 or newer, found 3.3.1",
                   "on a GPU it needs torch 2.8 or newer (torch.mm's out_dtype), found 2.7.1")
    assert launcher.version_needs(triton, "2.8.0", ["default", "out", "dtype_out", "dtype"]) == (None, None)
    triton_backend, cuda, cpu = backends.get("triton"), torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launcher, "device_capability", lambda device: (9, 0))
    assert triton_backend.unavailable_reason(cuda, torch.float16) is None
    monkeypatch.setattr(launcher, "TRITON_TOO_OLD", old[0])
    assert triton_backend.unavailable_reason(cuda, torch.float32) == old[0]
    assert triton_backend.unavailable_reason(cpu, torch.float32) == old[0]
    monkeypatch.setattr(launcher, "TRITON_TOO_OLD", None)
    monkeypatch.setattr(launcher, "TORCH_TOO_OLD", old[1])
    assert triton_backend.unavailable_reason(cuda, torch.float32) == old[1]
    assert triton_backend.unavailable_reason(cpu, torch.float32) != old[1]  # (a GPU's need alone)
