"""A short sweep over the Triton tile table (triton_kernels/launcher.py: tile_config) on a GPU:
each candidate's forward (mining + log-sum-exp launches) and backward launches (the fused form's
tiles, and the chunked form: config = [MiB of weights, weights tiles]) are timed separately
(median of CUDA-event timings), and their result (stats, or the gradients) is compared with the first
candidate's (the shipped tiles; for the backward, in the fused form), on the self case B = 16384, D = 512, for each dtype, and for the first dtype on the
memory-bank shape 1024 x 262144 and on 2048 anchors against a gathered batch of 16384 that takes a
gradient. The winners go into tile_config by hand, so that no user pays for
tuning.
    python bench/tune_triton.py --out tune.json
"""
import argparse
import json
import os
import statistics
import time
from typing import NamedTuple, Optional

import torch

from ms_loss_cuda.triton_kernels import backward_plan, forward_plan, launcher

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for the forward kernels, and with BLOCK_D for the
# backward: candidates around the table; the shipped entry (tile_config at D = 512) is put first.
FORWARD = {
    "16-bit": [(128, 128, 64, 8, 3), (128, 64, 64, 8, 3), (128, 64, 64, 4, 3), (64, 64, 64, 4, 3),
               (128, 128, 32, 8, 4), (64, 128, 64, 4, 3), (128, 128, 64, 8, 2), (128, 64, 32, 8, 4)],
    "float32": [(64, 32, 32, 8, 1), (64, 64, 32, 8, 2), (128, 64, 32, 8, 2), (64, 64, 16, 4, 2), (128, 32, 32, 8, 1),
                (64, 32, 32, 4, 2)],
}
BACKWARD = {
    "16-bit": [(64, 32, 64, 512, 8, 3), (64, 64, 64, 512, 8, 2), (64, 64, 64, 256, 8, 3), (64, 64, 32, 512, 8, 2),
               (64, 64, 64, 512, 8, 3), (64, 128, 64, 512, 8, 2), (64, 64, 128, 512, 8, 2), (64, 32, 64, 512, 8, 2)],
    "float32": [(64, 16, 32, 64, 4, 1), (64, 32, 32, 64, 4, 2), (64, 32, 32, 128, 8, 2), (128, 32, 32, 64, 8, 1),
                (64, 16, 32, 128, 8, 1), (32, 32, 32, 64, 4, 2)],
}


class Chunked(NamedTuple):
    """The chunked backward (pair weights to memory, cuBLAS for the second product) at `mib` MiB of
    weights, its weights_kernel on `tiles` (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages; None: the table's)."""
    mib: int
    tiles: Optional[tuple] = None


# timed beside the fused backward entries; the wider tiles read fewer operand bytes a pair (docs/triton.md,
# "The triangle": 64 x 64 tiles read 32 bytes a pair from L2, 128 x 64 24 and 128 x 128 16)
CHUNKED = {"16-bit": [Chunked(256), Chunked(64), Chunked(256, (128, 32, 32, 8, 4)), Chunked(256, (128, 32, 32, 4, 4)),
                      Chunked(256, (128, 32, 64, 8, 3)), Chunked(256, (64, 64, 32, 4, 4)),
                      Chunked(256, (128, 64, 32, 8, 4)), Chunked(256, (128, 128, 32, 8, 4)),
                      Chunked(256, (128, 128, 64, 8, 3))],
           "float32": [Chunked(64), Chunked(256)]}
SHIPPED = launcher.tile_config
# (B, R, the reference set takes a gradient): the self case, for the first dtype also a memory bank and
# one process's share of a batch gathered from 8 (bench/benchmark.py does not time that one)
SHAPES = ((16384, None, False), (1024, 262144, False), (2048, 16384, True))
MATCH = 1e-2  # the largest difference from the shipped entry's result, relative to its largest entry


def tile_names(kind):
    """What a candidate tuple of `kind` holds, in order."""
    return ("BLOCK_M", "BLOCK_N", "BLOCK_K") + (("BLOCK_D",) if kind == "backward" else ()) + ("num_warps", "num_stages")


def override(kind, values, table=SHIPPED):
    """`table` (default the shipped tile_config) with `values` for the kernels of `kind` (backward
    values: the fused backward's tiles, so CHUNK_BYTES 0, where a GPU's default is the chunked form)."""
    names = tile_names(kind)
    fused = {"CHUNK_BYTES": 0} if kind == "backward" else {}

    def config(k, dtype, dim, interpret=False, capability=(9, 0)):
        entry = table(k, dtype, dim, interpret, capability)
        return dict(entry, **dict(zip(names, values)), **fused) if k == kind else entry

    return config


def chunked(mib, tiles, table=SHIPPED):
    """`table` with the chunked backward of `Chunked(mib, tiles)` (the tiles of its triangle too)."""
    if tiles:
        weights = override("weights", tiles, table)
        triangle = dict(zip(tile_names("weights"), tiles))
        table = lambda kind, *args, **kwargs: dict(weights(kind, *args, **kwargs),  # noqa: E731
                                                   **({"TRIANGLE_TILES": triangle} if kind == "weights" else {}))
    return lambda kind, *args, **kwargs: dict(table(kind, *args, **kwargs),
                                              **({"CHUNK_BYTES": mib << 20} if kind == "backward" else {}))


def fastest(records, dtype, shape=SHAPES[0][:2]):
    """{kind: the record of the fastest configuration} of a sweep (tune.json) for `dtype` at `shape`
    (default the self case B = 16384, the targets' shape), among those whose result matched the
    shipped entry's."""
    best = {}
    for r in records:
        if (r["dtype"], r["batch"], r["ref"]) != (dtype, *shape) or not r.get("rel_diff", 1) < MATCH:
            continue  # (another case, or failed, or a result unlike the shipped entry's)
        if r["kind"] not in best or r["ms"] < best[r["kind"]]["ms"]:
            best[r["kind"]] = r
    return best


def winners(records, dtype, shape=SHAPES[0][:2]):
    """{kind: the fastest configuration} (`fastest`); a chunked backward comes back as a Chunked."""
    return {kind: Chunked(r["config"][0], r["config"][1] and tuple(r["config"][1])) if len(r["config"]) == 2
            else tuple(r["config"]) for kind, r in fastest(records, dtype, shape).items()}


def tuned_table(found):
    """tile_config with the `winners` applied: the forward's tiles, and the backward's fused tiles or
    its chunked form (a fused winner: CHUNK_BYTES 0, `override`)."""
    table = override("forward", found["forward"]) if "forward" in found else SHIPPED
    backward = found.get("backward")
    if isinstance(backward, Chunked):
        return chunked(*backward, table)
    return override("backward", backward, table) if backward else table


def difference(result, expected):
    """max |result - expected| / max |expected| over the finite entries: one wrong row shows, where a
    norm would hide it. The infinite entries (the statistics of an anchor without a positive or a
    negative) must be the same; a NaN, or an infinity where the other has none, gives inf."""
    finite = torch.isfinite(expected)
    if not torch.equal(torch.isfinite(result), finite) or not torch.equal(result[~finite], expected[~finite]):
        return float("inf")
    if not finite.any():
        return 0.0
    return float((result - expected)[finite].abs().max() / expected[finite].abs().max().clamp_min(1e-30))


def save(records, path):
    """The records so far, replacing `path` whole (a sweep cut short leaves a readable file)."""
    with open(path + ".part", "w") as f:
        json.dump(records, f, indent=1)
    os.replace(path + ".part", path)


def timed(launches, repeats=7):
    for launch in launches:  # warm-up (compiles)
        launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for launch in launches:
            launch()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def inputs(batch, ref_rows, dim, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = batch if ref_rows is None else ref_rows
    centres = torch.randn(rows // 4 + 1, dim, generator=gen, device="cuda")
    labels = torch.arange(rows, device="cuda") // 4
    data = torch.nn.functional.normalize(centres[labels] + 2.0 * torch.randn(rows, dim, generator=gen, device="cuda"))
    data = data.to(dtype)
    if ref_rows is None:
        return (data, labels, None, None, None, None)
    return (data[:batch].contiguous(), labels[:batch], None, data, labels, None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="tune.json")
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16", "float32"])
    parser.add_argument("--kinds", nargs="+", default=["forward", "backward"], choices=("forward", "backward"))
    parser.add_argument("--candidates", type=int, default=8, help="the first N of each list")
    parser.add_argument("--shapes", type=int, default=len(SHAPES),
                        help="the first N of SHAPES for the first dtype (1: the self case, where winners are picked)")
    args = parser.parse_args()
    hyper = (2.0, 50.0, 0.5, 0.1, True, False)
    records = []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        group = "float32" if dtype == torch.float32 else "16-bit"
        for batch, ref_rows, ref_grad in SHAPES[:args.shapes if name == args.dtypes[0] else 1]:
            operands = inputs(batch, ref_rows, 512, dtype)
            for kind, candidates in (("forward", FORWARD[group]), ("backward", BACKWARD[group])):
                if kind not in args.kinds:
                    continue
                shipped = SHIPPED(kind, dtype, 512, False, torch.cuda.get_device_capability())
                first = tuple(shipped[n] for n in tile_names(kind))
                candidates = [first] + [c for c in candidates if c != first]
                expected = None  # the first candidate's result: every candidate must compute the same
                for values in candidates[:args.candidates] + (CHUNKED[group] if kind == "backward" else []):
                    launcher.tile_config = chunked(*values) if isinstance(values, Chunked) else override(kind, values)
                    record = dict(dtype=name, batch=batch, ref=ref_rows, ref_grad=ref_grad, kind=kind, config=values)
                    try:
                        start = time.perf_counter()
                        _, stats, forward = forward_plan(*operands, *hyper)
                        if kind == "forward":
                            record["ms"] = timed(forward)
                            # (an empty set's LP or LN, stored as +inf, compared as its log(1 + 0): a last bit of
                            # S may empty a set under one tile and not another)
                            result = stats.clone()
                            result[2:4].masked_fill_(result[2:4] == float("inf"), 0.0)
                        else:
                            for launch in forward:
                                launch()
                            *grads, backward = backward_plan(torch.ones(batch, device="cuda"), stats, *operands,
                                                             *hyper, ref_grad=ref_grad)
                            record["ms"] = timed(backward)
                            result = torch.cat([(g.float().sum(0) if g.dim() == 3 else g.float()).flatten()
                                                for g in grads])  # (split partials summed; dref when there is one)
                        record["wall_s"] = time.perf_counter() - start
                        expected = result if expected is None else expected
                        record["rel_diff"] = difference(result, expected)
                    except Exception as error:  # noqa: BLE001  (out of resources: recorded, the sweep goes on)
                        record["error"] = f"{type(error).__name__}: {str(error)[:200]}"
                    launcher.tile_config = SHIPPED
                    records.append(record)
                    print(json.dumps(record), flush=True)
                    save(records, args.out)
    print(f"\nwinners (ms; each list's first: the shipped tiles, the backward's fused; results within {MATCH} "
          "of its):")
    for name in args.dtypes:
        for shape in [shape[:2] for shape in SHAPES]:
            for kind, best in fastest(records, name, shape).items():
                first = next(r for r in records if (r["dtype"], r["batch"], r["ref"], r["kind"]) == (name, *shape, kind))
                print(f"{name:9} {str(shape):16} {kind:8} first {first.get('ms', float('nan')):.3f} ms "
                      f"{first['config']} -> best {best['ms']:.3f} ms {best['config']} "
                      f"(relative difference {best['rel_diff']:.1e})")


if __name__ == "__main__":
    main()
