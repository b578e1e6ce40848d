"""The MS loss and miner as a user writes them in plain torch instead of using this library: dense
(the B x R similarity matrix and its masks in memory), written independently of ms_loss_cuda. The
benchmark's `compiled` and `compiled-graph` providers run `dense_ms_loss` under torch.compile, as
`compiled` builds it.

`check` compares the compiled function, loss and gradient in float64, with ms_loss_cuda's reference
backend on small data whose mining keeps a proper subset of the pairs: the benchmark runs it once per
run before timing, so that both sides of the comparison compute the same function
(tests/test_compiled_loss.py runs it too).
"""
import torch
import torch.nn.functional as F


def dense_ms_loss(x, labels, ref=None, ref_labels=None, alpha=2.0, beta=50.0, base=0.5, epsilon=0.1, mining=True):
    """Mean MS loss of x [B, D] against a memory bank ref [R, D] (x itself, diagonal skipped, when None)."""
    x = F.normalize(x, dim=1)
    self_case = ref is None
    ref, ref_labels = (x, labels) if self_case else (F.normalize(ref, dim=1), ref_labels)
    s = (x @ ref.T).to(torch.promote_types(x.dtype, torch.float32))  # exponents and sums: float32 at least
    return loss_of_similarities(s, labels, ref_labels, self_case, alpha, beta, base, epsilon, mining)


def loss_of_similarities(s, labels, ref_labels, self_case, alpha=2.0, beta=50.0, base=0.5, epsilon=0.1, mining=True):
    """dense_ms_loss from the similarities s [B, R] of unit rows (self_case: of the batch with itself)."""
    same = labels[:, None] == ref_labels[None, :]
    pos, neg = same, ~same
    if self_case:
        pos = pos & ~torch.eye(len(s), dtype=torch.bool, device=s.device)
    if mining:  # against each anchor's hardest negative / positive, the similarities taken as constants
        sd = s.detach()
        hardest_neg = sd.masked_fill(~neg, float("-inf")).amax(dim=1, keepdim=True)
        hardest_pos = sd.masked_fill(~pos, float("inf")).amin(dim=1, keepdim=True)
        pos, neg = pos & (sd - epsilon < hardest_neg), neg & (sd + epsilon > hardest_pos)
    pos_term = torch.log1p(torch.where(pos, torch.exp(-alpha * (s - base)), 0).sum(dim=1)) / alpha
    neg_term = torch.log1p(torch.where(neg, torch.exp(beta * (s - base)), 0).sum(dim=1)) / beta
    return (pos_term + neg_term).mean()


def compiled(graphs=False):
    """dense_ms_loss under torch.compile: default mode, or with `graphs` mode="reduce-overhead" (torch's CUDA
    graphs; each call then begins a new step, so that the last step's outputs may be overwritten).
    Dynamo's caches are cleared first, so that the first call compiles afresh for its static shape, as a
    training loop at one batch size gets."""
    torch.compiler.reset()
    loss = torch.compile(dense_ms_loss, mode="reduce-overhead" if graphs else None)
    if not graphs:
        return loss

    def replayed(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return loss(*args, **kwargs)

    return replayed


def check_data(bank=False, device="cpu", batch=64, dim=32, classes=16, noise=1.5, seed=0):
    """float64 (x, labels, ref, ref_labels): P x 4 rows around class centres (ref None without `bank`;
    with it, 1.5 * batch bank rows of random classes)."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=gen, dtype=torch.float64)
    labels = torch.arange(batch) % classes
    x = centres[labels] + noise * torch.randn(batch, dim, generator=gen, dtype=torch.float64)
    ref = ref_labels = None
    if bank:
        ref_labels = torch.randint(0, classes, (batch * 3 // 2,), generator=gen)
        ref = centres[ref_labels] + noise * torch.randn(len(ref_labels), dim, generator=gen, dtype=torch.float64)
        ref, ref_labels = ref.to(device), ref_labels.to(device)
    return x.to(device), labels.to(device), ref, ref_labels


def check(loss_fn, device="cpu", bank=False, mining=True, calls=1, rtol=1e-9):
    """Loss and gradient of loss_fn(x, labels, ref, ref_labels, mining=...) against ms_loss_cuda's
    reference backend on check_data, from the last of `calls` calls (CUDA graphs replay from the third);
    raises AssertionError on a mismatch, or when mining keeps all of the pairs or none. Returns the
    larger relative error (loss, gradient)."""
    import ms_loss_cuda
    from ms_loss_cuda import reference

    x, labels, ref, ref_labels = check_data(bank, device)
    if mining:
        kept = reference.mined_fraction(x, labels, ref, ref_labels, anchors=len(x))
        if not 0.05 < kept < 0.95:
            raise AssertionError(f"mining keeps {kept:.0%} of the pairs: no proper subset to check")
    results = []
    for fn, times in ((loss_fn, calls), (lambda *a, mining: ms_loss_cuda.multi_similarity_loss(
            a[0], a[1], ref_embeddings=a[2], ref_labels=a[3], mining=mining, backend="reference"), 1)):
        for _ in range(times):
            leaf = x.clone().requires_grad_()
            loss = fn(leaf, labels, ref, ref_labels, mining=mining)
            loss.backward()
        results.append((loss.detach().double().clone(), leaf.grad.double().clone()))
    (loss, grad), (want_loss, want_grad) = results
    errors = (abs(loss - want_loss).item() / abs(want_loss).item(),
              (grad - want_grad).abs().max().item() / want_grad.abs().max().item())
    what = f"{'bank' if bank else 'self'} case, mining={mining}, {device}"
    if errors[0] > rtol:  # (raised, not asserted: the benchmark stops on it under python -O too)
        raise AssertionError(f"loss {loss.item()!r} against the reference's {want_loss.item()!r} ({what})")
    if errors[1] > rtol:
        raise AssertionError(f"gradient off by {errors[1]:.3g} of its largest entry ({what})")
    return max(errors)
