"""Embedding-gradient caching: the chunked step's parameter gradients against the plain step's."""
import types

import pytest
import torch

import ms_loss_cuda
from ms_loss_cuda import gradient_cache
from ms_loss_cuda.train.models import SmallConvNet, freeze_batchnorm


def _convnet():
    torch.manual_seed(0)
    model = SmallConvNet(dim=12, in_channels=1, width=4).double()
    for module in model.modules():  # batch-norm statistics that are not the identity
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return freeze_batchnorm(model.train())


def _grads(model):
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("chunk_size", [1, 7, 23, 64])
@pytest.mark.parametrize("with_memory", [False, True])
def test_cached_step_equals_plain_step(chunk_size, with_memory):
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(23, 1, 16, 16, generator=gen, dtype=torch.float64)  # 23: no chunk size divides it
    labels = torch.arange(23) % 5
    ids = torch.arange(100, 123)
    options = dict(backend="reference", reduction="sum", epsilon=0.3)

    def loss_fn_for(memory):
        if memory is None:
            return lambda e: ms_loss_cuda.multi_similarity_loss(e, labels, ids=ids, **options)
        return lambda e: memory(e, labels, ids)

    results = []
    for cached in (False, True):
        model = _convnet()
        memory = None
        if with_memory:  # a memory holding an earlier batch, so the memory term has negatives and positives
            memory = ms_loss_cuda.CrossBatchMemory(40, 12, weight=0.7, **options).double()
            with torch.no_grad():
                memory(model(torch.randn(17, 1, 16, 16, generator=torch.Generator().manual_seed(2),
                                         dtype=torch.float64)), torch.arange(17) % 5, torch.arange(17))
        loss_fn = loss_fn_for(memory)
        if cached:
            loss, embeddings = gradient_cache.cached_step(model, images, loss_fn, chunk_size)
        else:
            embeddings = model(images)
            loss = loss_fn(embeddings)
            loss.backward()
        results.append((loss.detach(), embeddings.detach(), _grads(model)))
    (plain_loss, plain_emb, plain_grads), (loss, emb, grads) = results
    torch.testing.assert_close(loss, plain_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(emb, plain_emb, rtol=1e-10, atol=1e-12)
    assert any(g.abs().max() > 0 for g in plain_grads)
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def _model_and_inputs(middle, seed):
    """Linear, `middle`, Linear in float64, and 19 inputs (no chunk size of 5 divides them), from `seed`."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), middle, torch.nn.Linear(16, 5)).double(), \
        torch.randn(19, 6, dtype=torch.float64)


def _chunked_step(encode, inputs, loss_fn):
    """The forward with a graph in chunks of 5, and its backward: what cached_step(..., 5) must equal."""
    loss = loss_fn(torch.cat([encode(inputs[i:i + 5]) for i in range(0, len(inputs), 5)]))
    loss.backward()
    return loss.detach()


def _loss_of(labels):
    return lambda e: ms_loss_cuda.multi_similarity_loss(e, labels, backend="reference")


def test_random_layers_replay_the_same_numbers():
    """With dropout, each chunk's second pass draws the first pass's random numbers: the gradients
    are those of the chunked forward with graph, run from the same seed."""
    loss_fn = _loss_of(torch.arange(19) % 4)
    model, inputs = _model_and_inputs(torch.nn.Dropout(0.5), 3)
    torch.manual_seed(11)
    loss = _chunked_step(model, inputs, loss_fn)
    want = _grads(model)
    model, inputs = _model_and_inputs(torch.nn.Dropout(0.5), 3)
    torch.manual_seed(11)
    cached_loss, _ = gradient_cache.cached_step(model, inputs, loss_fn, 5)
    torch.testing.assert_close(cached_loss, loss)
    for got, expected in zip(_grads(model), want):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("given", ["module", "model="])
def test_batch_norm_statistics_are_updated_once_a_chunk(given):
    """Batch-norm in training mode: the running statistics after a cached step are those of the
    chunked forward with a graph (each chunk once), not twice that, whether `encode` is the module or
    a function of it (then named by model=)."""
    loss_fn = _loss_of(torch.arange(19) % 4)
    model, inputs = _model_and_inputs(torch.nn.BatchNorm1d(16), 5)
    _chunked_step(model, inputs, loss_fn)
    want = [b.clone() for b in model.buffers()]
    model, inputs = _model_and_inputs(torch.nn.BatchNorm1d(16), 5)
    if given == "module":
        gradient_cache.cached_step(model, inputs, loss_fn, 5)
    else:
        gradient_cache.cached_step(lambda chunk: model(chunk), inputs, loss_fn, 5, model=model)
    for got, expected in zip(model.buffers(), want):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    assert model[1].num_batches_tracked.item() == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_dropout_on_the_gpu_replays_for_inputs_that_the_encoder_moves_there():
    loss_fn = _loss_of(torch.arange(19, device="cuda") % 4)
    model, inputs = _model_and_inputs(torch.nn.Dropout(0.5), 3)
    model.cuda()
    encode = lambda chunk: model(chunk.cuda())  # noqa: E731  (CPU inputs)
    torch.cuda.manual_seed(11)
    _chunked_step(encode, inputs, loss_fn)
    want = _grads(model)
    model.zero_grad()
    torch.cuda.manual_seed(11)
    gradient_cache.cached_step(encode, inputs, loss_fn, 5)
    for got, expected in zip(_grads(model), want):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_the_random_states_replayed_are_those_of_the_models_gpus():
    """An encoder may move CPU inputs to its model's GPU, which need not be the current one: the GPUs of
    the model's parameters and buffers are the ones whose random numbers are replayed (stood in for here:
    their devices alone)."""
    on = lambda index: types.SimpleNamespace(device=torch.device("cuda", index))  # noqa: E731
    model = types.SimpleNamespace(parameters=lambda: [on(1), on(1)], buffers=lambda: [on(2)])
    assert gradient_cache._cuda_devices(torch.zeros(3), model) == [1, 2]
    current = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    assert gradient_cache._cuda_devices(torch.zeros(3), torch.nn.Linear(2, 2)) == current


def test_bad_chunk_size_and_empty_batch():
    for chunk_size in (0, 2.5, None, "4", True):
        with pytest.raises(ValueError, match="chunk_size must be an integer >= 1"):
            gradient_cache.cached_step(torch.nn.Linear(2, 2), torch.zeros(3, 2), lambda e: e.sum(), chunk_size)
    with pytest.raises(ValueError, match="at least one input"):
        gradient_cache.cached_step(torch.nn.Linear(2, 2), torch.zeros(0, 2), lambda e: e.sum(), 4)
    with pytest.raises(ValueError, match=r"a scalar loss .*, got \(3,\)"):
        gradient_cache.cached_step(torch.nn.Linear(2, 2), torch.zeros(3, 2), lambda e: e.sum(1), 2)


def test_encoders_inputs_and_losses_it_cannot_use_are_named():
    linear, x = torch.nn.Linear(2, 2), torch.zeros(6, 2)
    with pytest.raises(TypeError, match="inputs must be a tensor .* or a sequence of B samples, .* got dict"):
        gradient_cache.cached_step(linear, {"x": x}, lambda e: e.sum(), 2)
    for encode, got in ((lambda chunk: (linear(chunk),), "tuple"), (lambda chunk: linear(chunk).long(), "torch.int64"),
                        (lambda chunk: linear(chunk)[:1], r"torch.float32 \(1, 2\)")):
        with pytest.raises(ValueError, match=rf"encode must return .*: inputs\[0:4\] gave {got}"):
            gradient_cache.cached_step(encode, x, lambda e: e.sum(), 4)
    # a tuple of batch tensors is sliced into tensors: two of them, each a whole batch, not two samples
    with pytest.raises(ValueError, match=r"inputs\[0:2\] gave torch.float32 \(6, 2\)"):
        gradient_cache.cached_step(lambda parts: linear(parts[0]), (x, x), lambda e: e.sum(), 4)
    for loss_fn in (lambda e: torch.tensor(3.0), lambda e: e.sum().detach()):
        with pytest.raises(ValueError, match="loss_fn's loss takes no gradient from the embeddings"):
            gradient_cache.cached_step(linear, x, loss_fn, 4)
    with torch.no_grad(), pytest.raises(ValueError, match="loss_fn's loss takes no gradient"):
        gradient_cache.cached_step(linear, x, lambda e: e.sum(), 4)
    scale = torch.ones((), requires_grad=True)  # (a loss of the parameter alone)
    with pytest.raises(ValueError, match="loss_fn's loss does not depend on the embeddings"):
        gradient_cache.cached_step(linear, x, lambda e: scale * 2, 4)


def test_parameters_the_loss_itself_uses_get_their_gradients():
    """A learnable scale of the loss and a weight penalty inside loss_fn: their gradients accumulate as
    loss.backward() would accumulate them, beside the encoder's."""
    labels = torch.arange(19) % 4
    results = []
    for cached in (False, True):
        model, inputs = _model_and_inputs(torch.nn.Tanh(), seed=3)
        scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)

        def loss_fn(e):
            return scale * _loss_of(labels)(e) + 1e-2 * model[0].weight.square().sum()

        if cached:
            gradient_cache.cached_step(model, inputs, loss_fn, 5)
        else:
            _chunked_step(model, inputs, loss_fn)
        results.append([scale.grad] + _grads(model))
    assert results[0][0] is not None and results[0][0] != 0
    for got, want in zip(*results[::-1]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
