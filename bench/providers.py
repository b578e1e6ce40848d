"""What bench/benchmark.py times: the data and one forward+backward step of each provider.

Providers (PROVIDER_HELP says each in a line, for the printed table's legend):
`floor` (forward+backward of X @ X.T alone: the GEMM work no exact method avoids), `matmul4` (four
X @ X.T products: the issues' GPU yardstick, as the fused forward+backward does four
GEMM-equivalents), `reference` (ms_loss_cuda's dense PyTorch backend), the fused backends `cpu`,
`triton` and `cuda` (`cpu-ops`: `cpu` through the path torch.compile traces, its custom ops with
torch's normalisation and reduction around them, where an eager call is one autograd node; on a GPU
`triton` replays its eager step as a CUDA graph from the second call of a shape; `triton-direct`
launches it every time), `triton-fused` (the triton backend's fused
backward, MS_LOSS_TRITON_CHUNK_MB=0; on a GPU plain `triton` takes the chunked one: pair weights to
memory 256 MiB at a time, the second product by cuBLAS), `triton-chunk192` and `triton-chunk128`
(the chunked backward at 192 and 128 MiB of pair weights), `triton-tuned` (with --tuned tune.json:
the triton step on the winners of bench/tune_triton.py's sweep at B = 16384 for this dtype, forward
tiles and backward form, so that one GPU call can sweep and time them beside the shipped entries),
`compiled` (the dense MS loss and miner written plainly in torch, bench/compiled_loss.py, under
torch.compile: what a user writes instead of this library), `pml` (pytorch-metric-learning's
MultiSimilarityLoss + MultiSimilarityMiner), `triton-unsplit` (float32: the chunked backward's cuBLAS
products in float32, without their float16 pieces), `triton-fp16x3` (float32: the S tiles as three
float16 products of split unit rows), `triton-resident` (16-bit: the
negatives and weights kernels on rows loaded once and kept), `triton-symmetric` (the self case's
negatives pass on half of S's tiles, as float32 on sm_90 ships), `triton-unsymmetric` (the self
case's negatives pass on every tile, as the other entries ship), `triton-unmirrored` (the self case's
chunked backward on every tile of each chunk's square; all five bench/triton_internals.py), and
`NAME-graph` (CUDA only: triton's steps captured once in a CUDA graph and replayed, no host work per
step; `compiled-graph` is torch.compile(mode="reduce-overhead"), torch's own CUDA graphs).

The data is a P x M batch (M = PER_CLASS samples per class around class centres); the hardness sets
the noise and so the fraction of pairs mining keeps: easy (noise 1.2, under 0.1%), typical (2.0,
9-15% at the benchmark's sizes), hard (3.0, about 75%). The lines that reach into the Triton backend's internals (its tile
table, its backward's products) live in bench/triton_internals.py alone.
"""
import os

TRITON = ("triton", "triton-direct", "triton-graph", "triton-fused", "triton-fused-graph")
TUNED = ("triton-tuned", "triton-tuned-graph")  # with --tuned
SPLIT = ("triton-unsplit", "triton-fp16x3")  # on request: float32's alone differ from triton
BUDGETS = {"triton-chunk192": "192", "triton-chunk128": "128"}  # on request: MS_LOSS_TRITON_CHUNK_MB
RESIDENT = ("triton-resident",)  # on request
SELF_CASE = ("triton-symmetric", "triton-unsymmetric", "triton-unmirrored")  # on request; a bank runs as triton
COMPILED = ("compiled", "compiled-graph")
PROVIDERS = ("floor", "matmul4", "reference", "cpu", "cpu-ops", *TRITON, *TUNED, *SPLIT, *BUDGETS, *RESIDENT,
             *SELF_CASE, "cuda", *COMPILED, "pml")
FUSED = ("cpu", "cpu-ops", *TRITON, *TUNED, *SPLIT, *BUDGETS, *RESIDENT, *SELF_CASE, "cuda")
DEFAULT_PROVIDERS = {"cpu": ("floor", "reference", "cpu", "compiled", "pml"),
                     "cuda": ("matmul4", "reference", *TRITON, "cuda", *COMPILED, "pml")}
PROVIDER_HELP = {
    "floor": "X @ X.T (X @ R.T with a bank) forward+backward alone: the GEMM work no exact method avoids",
    "matmul4": "four X @ X.T products, no backward: the GPU yardstick (an unfused dense step's products)",
    "reference": "ms_loss_cuda's dense PyTorch backend (the B x R matrix in memory)",
    "cpu": "ms_loss_cuda's fused C++ backend (no B x R matrix beyond MS_LOSS_CPU_SAVED_MB of pair weights)",
    "cpu-ops": "the cpu backend through its custom ops with torch's normalisation and reduction (the path"
               " torch.compile traces), where an eager call of cpu is one autograd node",
    "triton": "ms_loss_cuda's Triton backend (on a GPU its chunked backward: 256 MiB of pair weights at a time)",
    "triton-direct": "the Triton backend's eager step launched every time, without its CUDA-graph replay"
                     " (MS_LOSS_CUDA_GRAPHS=0)",
    "triton-fused": "the Triton backend with its fused backward (MS_LOSS_TRITON_CHUNK_MB=0)",
    "triton-tuned": "the Triton backend on the winners of bench/tune_triton.py's sweep (--tuned)",
    "triton-unsplit": "the Triton backend, its float32 backward's cuBLAS products in float32, without their"
                      " float16 pieces (bench/triton_internals.py)",
    "triton-fp16x3": "the Triton backend, its float32 S tiles as three float16 products of split unit rows"
                     " (bench/triton_internals.py)",
    "triton-resident": "the Triton backend, its negatives and weights kernels on rows loaded once and kept for"
                       " every column tile, which then reads only its columns (bench/triton_internals.py)",
    "triton-symmetric": "the Triton backend, its self-case negatives pass on half of S's tiles, each summed for its"
                        " rows and its columns (bench/triton_internals.py)",
    "triton-unsymmetric": "the Triton backend, its self-case negatives pass on every tile of S, where float32 on"
                          " sm_90 takes half of them (bench/triton_internals.py)",
    "triton-unmirrored": "the Triton backend, its self-case chunked backward on every tile of each chunk's own"
                         " square, where triton mirrors half of them (bench/triton_internals.py)",
    "triton-chunk192": "the Triton backend's chunked backward at 192 MiB of pair weights (MS_LOSS_TRITON_CHUNK_MB=192)",
    "triton-chunk128": "the Triton backend's chunked backward at 128 MiB of pair weights (MS_LOSS_TRITON_CHUNK_MB=128)",
    "cuda": "ms_loss_cuda's CUDA C++ backend",
    "compiled": "the dense loss + miner written plainly in torch (bench/compiled_loss.py) under torch.compile;"
                " compiled by its first call, untimed",
    "pml": "pytorch-metric-learning's MultiSimilarityLoss + MultiSimilarityMiner",
}
HARDNESS = {"easy": 1.2, "typical": 2.0, "hard": 3.0}  # noise around the class centres
PER_CLASS = 4


def describe(provider):
    """PROVIDER_HELP's line for `provider`; NAME-graph: NAME's step replayed as a CUDA graph."""
    if provider == "compiled-graph":
        return 'compiled under torch.compile(mode="reduce-overhead"): torch\'s CUDA graphs'
    if provider.endswith("-graph"):
        return f"the {provider[:-len('-graph')]} step captured once in a CUDA graph and replayed"
    return PROVIDER_HELP[provider]


def make_inputs(batch, dim, noise=HARDNESS["typical"], ref_rows=None, device="cpu", seed=0):
    """SOP-like P x M data, float32: a batch of `batch` rows (PER_CLASS per class) and, when
    `ref_rows` is given, a memory bank of that many rows of the same classes (and more)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    rows = batch if ref_rows is None else max(batch, ref_rows)
    centres = torch.randn(rows // PER_CLASS + 1, dim, generator=gen, device=device)

    def draw(n):
        labels = torch.arange(n, device=device) // PER_CLASS
        return centres[labels] + noise * torch.randn(n, dim, generator=gen, device=device), labels

    x, labels = draw(batch)
    ref, ref_labels = draw(ref_rows) if ref_rows is not None else (None, None)
    return x, labels, ref, ref_labels


def step_function(provider, labels, ref=None, ref_labels=None, mining=True, tuned=None):
    """One forward+backward of `provider` on embeddings x (and the fixed bank `ref`); mining=False:
    every pair (pytorch-metric-learning's loss without its miner); `tuned`: the tile table of the
    triton-tuned providers."""
    if provider == "floor":
        return lambda x: (x @ (x if ref is None else ref).T).sum().backward()
    if provider == "matmul4":
        def four_products(x):
            for _ in range(4):
                x.detach() @ (x if ref is None else ref).detach().T  # each freed before the next
        return four_products
    if provider == "pml":
        from pytorch_metric_learning import losses, miners

        loss, miner = losses.MultiSimilarityLoss(), miners.MultiSimilarityMiner()
        if not mining:
            return lambda x: loss(x, labels, ref_emb=ref, ref_labels=ref_labels).backward()
        if ref is None:
            return lambda x: loss(x, labels, miner(x, labels)).backward()
        return lambda x: loss(x, labels, miner(x, labels, ref, ref_labels), ref, ref_labels).backward()
    if provider in COMPILED:
        return compiled_step(labels, ref, ref_labels, mining, graphs=provider == "compiled-graph")
    import ms_loss_cuda

    if provider.endswith("-graph"):
        return graphed(step_function(provider[:-len("-graph")], labels, ref, ref_labels, mining, tuned))
    step = lambda x: ms_loss_cuda.multi_similarity_loss(  # noqa: E731
        x, labels, ref_embeddings=ref, ref_labels=ref_labels, mining=mining,
        backend=provider.split("-")[0]).backward()
    if provider == "cpu-ops":
        return as_if_traced(step)
    if provider.startswith("triton"):  # the shipped backward, the fused one or another budget (triton-tuned: its own)
        budget = "0" if provider == "triton-fused" else BUDGETS.get(provider)
        step = with_settings(step, budget, provider != "triton-direct")
        if provider in ("triton-tuned", "triton-unsplit", "triton-fp16x3") + RESIDENT + SELF_CASE:
            import triton_internals as internals  # (bench/, this module's folder)

            if provider == "triton-unsplit":
                return internals.within(step, internals.unsplit_products)
            table = tuned if provider == "triton-tuned" else internals.TABLES[provider]()
            return internals.within(step, lambda: internals.tiles(table))
    return step


def as_if_traced(step):
    """`step` with ms_loss_cuda.ops.traced() true during each call: the loss takes the path torch.compile
    traces, run eagerly (two attribute swaps a call; mock.patch would add its own host time)."""
    from ms_loss_cuda import ops

    def run(x):
        shipped, ops.traced = ops.traced, lambda: True
        try:
            step(x)
        finally:
            ops.traced = shipped

    return run


def compiled_step(labels, ref, ref_labels, mining, graphs=False):
    """The step of `compiled` (graphs: `compiled-graph`): bench/compiled_loss.py's dense loss under
    torch.compile, compiled afresh by the first call. With CUDA graphs the bank is marked static, as a
    module's buffer is, so that each replay reads it in place instead of copying it in first."""
    import torch

    import compiled_loss  # (bench/, this module's folder)

    loss = compiled_loss.compiled(graphs)
    if graphs and ref is not None:
        torch._dynamo.mark_static_address(ref)
    return lambda x: loss(x, labels, ref, ref_labels, mining=mining).backward()


def with_settings(step, chunk_mib, replay):
    """`step` under MS_LOSS_TRITON_CHUNK_MB=chunk_mib (0: the triton backend's fused backward; None:
    unset, the shipped default) and, without `replay`, MS_LOSS_CUDA_GRAPHS=0, set before each call, as
    every triton provider does (setenv alone: copying and restoring the whole environment, as
    mock.patch.dict does, would add host time to every timed step)."""
    def setenv(name, value):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

    def run(x):
        setenv("MS_LOSS_TRITON_CHUNK_MB", chunk_mib)
        setenv("MS_LOSS_CUDA_GRAPHS", None if replay else "0")
        step(x)

    return run


def graphed(step):
    """`step`, captured in a CUDA graph on its first call (after warm-up runs on a side stream, as
    torch.cuda.graphs asks) and replayed afterwards: what a training loop gets from
    torch.cuda.make_graphed_callables or torch.compile(mode="reduce-overhead"). Each replay writes
    x.grad in the graph's own memory."""
    import torch

    graph = torch.cuda.CUDAGraph()
    captured = []

    def run(x):
        if not captured:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    x.grad = None
                    step(x)
            torch.cuda.current_stream().wait_stream(side)
            x.grad = None
            with torch.cuda.graph(graph):
                step(x)
            captured.append(True)
        graph.replay()

    return run
