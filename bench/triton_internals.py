"""The benchmark's only reach into the Triton backend's internals: its tile table, for the
triton-tuned providers (--tuned tune.json, the winners of bench/tune_triton.py's sweep),
triton-fp16x3, triton-resident, triton-symmetric, triton-unsymmetric and triton-unmirrored, and the
chunked backward's choice of products, for triton-unsplit.

triton-resident asks whether the forward's negatives kernel and the chunked backward's weights are
bound by the operand bytes their tiles read from L2: both read about 6.5 TB/s of operands in the
profiled H100 step, 16 and 32 bytes a pair. Nsight Compute put the negatives kernel at 37% of L2's
peak, and a variant that read all of D in one block gained nothing (docs/triton.md, "Operand
traffic of the negatives pass"), so a small gain would not surprise. With
the rows resident a tile reads only its 32 columns, 8 bytes a pair; a weights program, which holds
one tile, walks several.

triton-symmetric asks how much the forward gains from S's symmetry in the self case. The 16-bit
negatives pass computes every tile of S once for its rows; symmetric_negatives_kernel computes half
of them and sums each for both ends, its rows and its columns, so it does half the products and
the same exponentials, and writes a partial per column tile (3 B^2 / 256 floats,
so batches whose partials pass 256 MiB keep the full pass). How much of the pass the products
take on a GPU is what it measures. float32 on sm_90 ships the symmetric pass, as its three TF32
products a tile make it bound by its products (launcher.tile_config); triton-unsymmetric times the
full pass there.

triton-unmirrored measures what the chunked backward gains from S's symmetry within each chunk's
own square. The shipped weights kernel computes a tile of the square right of its rows' diagonal
block once and stores it at both places, and skips the tiles left of it (MIRROR, weights_kernel), so
a batch that fits one chunk (B = 4096) computes about half of S, where triton-unmirrored computes
all of it, and the triangle (B = 16384) half instead of three quarters. The mirrored tiles' stores
are transposed, through shared memory, and their programs hold more registers (sm_90: 173 against
159 on whole rows); how the two weigh against the halved products is what it measures.

triton-fp16x3 asks whether the float32 S tiles should take float16 tensor cores. Their shipped form,
"tf32x3", is three TF32 products. "fp16x3" is three float16 products of unit rows split into a float16
part and the rest scaled by 2^11 (pairs.similarity_tile). Hopper's float16 rate is twice its TF32
rate, and compiled for sm_90 the kernels issue half the wgmma instructions, without spills
(bench/kernel_resources.py --dtype float32 --precision fp16x3). It is valid for rows of magnitude at
most 1, as the loss's own normalisation makes them.

triton-unsplit measures what the float32 backward gains from its products' float16 pieces. Under
torch's default float32 precision ("highest") the chunked backward writes float32 unit rows and their
weights as float16 high parts and scaled rests (backward.split_products), and cuBLAS multiplies them
as three float16 products on tensor cores. triton-unsplit turns that off: float32 weights and one
cuBLAS float32 product each, which torch runs on CUDA cores under "highest" (about 50 TFLOP/s on an
H100, against several hundred for float16).
"""
import contextlib
import json


@contextlib.contextmanager
def tiles(table):
    """Within: the triton backend's tile table (launcher.tile_config, read by every launch plan) replaced
    by `table`."""
    from ms_loss_cuda.triton_kernels import launcher

    shipped, launcher.tile_config = launcher.tile_config, table
    try:
        yield
    finally:
        launcher.tile_config = shipped


def within(step, context):
    """`step`, each call of it within `context()` (`tiles(table)`, `unsplit_products()`, ...)."""
    def run(x):
        with context():
            step(x)

    return run


def _amended(table, amend):
    """`table` (the shipped tile table unless given) with each of its entries passed through
    amend(entry, kind, dtype, dim, capability), which returns the entry to use."""
    from ms_loss_cuda.triton_kernels import launcher

    table = table or launcher.tile_config

    def config(kind, dtype, dim, interpret=launcher.INTERPRETED, capability=(9, 0)):
        return amend(table(kind, dtype, dim, interpret, capability), kind, dtype, dim, capability)

    return config


def fp16x3_tiles(table=None):
    """`table` (the shipped tile table unless given) with float32's S tiles as "fp16x3"."""
    import torch

    return _amended(table, lambda entry, kind, dtype, dim, capability:
                    dict(entry, PRECISION="fp16x3") if dtype == torch.float32 else entry)


WEIGHTS_COLUMN_TILES = 8  # triton-resident's weights programs: 8 column tiles of 32 a program


def resident_tiles(table=None):
    """`table` (the shipped tile table unless given) with the forward's negatives kernel on resident rows
    (triton-resident; 16-bit rows of D <= 512 on sm_90 and sm_100, whose 227 KiB of shared memory a
    program holds them in, where sm_80 and sm_120 have 163 and 99): each program loads its 128 rows
    once, keeps them and takes 128 x 32 column tiles, 2 stages (192 KiB of shared memory at D = 512),
    so that each tile reads only its columns. The same for the chunked backward's weights (the
    triangle's too), each program taking WEIGHTS_COLUMN_TILES tiles one after another where the
    shipped ones take one."""
    import torch

    from ms_loss_cuda.triton_kernels import launcher

    def amend(entry, kind, dtype, dim, capability):
        if kind not in ("forward", "weights") or dtype == torch.float32 or dim > 512 or \
                not (9, 0) <= capability < (12, 0):
            return entry
        resident = dict(BLOCK_N=32, num_stages=2, RESIDENT_D=launcher.pow2_at_least_16(dim))
        if kind == "forward":
            return dict(entry, NEGATIVES_TILES=resident)
        resident.update(BLOCK_M=entry["BLOCK_M"], num_warps=8, COLUMN_TILES=WEIGHTS_COLUMN_TILES)
        return dict(entry, **resident, TRIANGLE_TILES=resident)

    return _amended(table, amend)


def _negatives_pass(entry, symmetric):
    """A forward entry with the self case's negatives pass symmetric or not (NEGATIVES_TILES' SYMMETRIC)."""
    return dict(entry, NEGATIVES_TILES=dict(entry.get("NEGATIVES_TILES", {}), SYMMETRIC=symmetric))


def symmetric_tiles(table=None):
    """`table` (the shipped tile table unless given) with the self case's negatives pass on half the tiles
    (triton-symmetric: forward_kernels.symmetric_negatives_kernel, on square tiles of the forward's row
    blocks): where the forward's tiles are square (16-bit rows on a GPU, every dtype under the
    interpreter), and for float32 on sm_90, whose 128 x 128 tiles of TF32 products compile without
    spills (and where the shipped table takes it; sm_80's, sm_100's and sm_120's spill)."""
    def amend(entry, kind, dtype, dim, capability):
        if kind != "forward" or (entry["BLOCK_M"] != entry["BLOCK_N"] and capability[0] != 9):
            return entry
        return _negatives_pass(entry, True)

    return _amended(table, amend)


def unsymmetric_tiles(table=None):
    """`table` (the shipped tile table unless given) with the self case's negatives pass on every tile of S
    (triton-unsymmetric: forward_kernels.negatives_kernel, where float32 on sm_90 ships the symmetric
    pass)."""
    return _amended(table, lambda entry, kind, dtype, dim, capability:
                    _negatives_pass(entry, False) if kind == "forward" else entry)


def unmirrored_tiles(table=None):
    """`table` (the shipped tile table unless given) with the chunked backward's weights computing every
    tile of each chunk's square (triton-unmirrored)."""
    return _amended(table, lambda entry, kind, dtype, dim, capability:
                    dict(entry, MIRROR=False) if kind == "weights" else entry)


# the providers that stand a table in for the shipped one
TABLES = {"triton-fp16x3": fp16x3_tiles, "triton-resident": resident_tiles, "triton-symmetric": symmetric_tiles,
          "triton-unsymmetric": unsymmetric_tiles, "triton-unmirrored": unmirrored_tiles}


def tuned_from(path, dtype):
    """(tile table, what it holds) from a sweep of bench/tune_triton.py for `dtype` ("float32-tf32": none,
    the sweep runs float32 at torch's default precision); (None, why) when the sweep has no winner for it."""
    import tune_triton  # (bench/, this module's folder)

    try:
        with open(path) as f:
            found = tune_triton.winners(json.load(f), dtype)
    except (OSError, ValueError) as error:
        return None, f"{path} unreadable: {error}"
    if not found:
        return None, f"{path} has no winners for {dtype}"
    return tune_triton.tuned_table(found), {kind: repr(config) for kind, config in found.items()}


@contextlib.contextmanager
def unsplit_products():
    """Within: the chunked backward's float32 products as one float32 cuBLAS product each, without the
    float16 pieces (the module's docstring)."""
    from ms_loss_cuda.triton_kernels import backward

    shipped, backward.split_products = backward.split_products, lambda dtype, unit_rows: False
    try:
        yield
    finally:
        backward.split_products = shipped
