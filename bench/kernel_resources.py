"""Registers, spills and SASS instruction counts of the Triton kernels as the dispatcher launches
them, compiled ahead of time (no GPU needed: Triton's own ptxas and nvdisasm), with the shipped
tiles or others. Run it with the Triton of the GPU machines on the path to see what they compile;
tests/triton_aot.py checks every launch for spills with the Triton the project pins.
    python bench/kernel_resources.py [--cc 90] [--dtype float16] [--rows 4096] [--kernels negatives weights]
    python bench/kernel_resources.py --cc 75 --kernels minpos negatives finish grad  (T4: why Triton needs 8.0)
                                     [--tiles 128,64,64,8,3 ...]
    python bench/kernel_resources.py --dtype float32 --precision fp16x3   (float32's S tiles as float16 products)
    python bench/kernel_resources.py --table triton-resident --kernels negatives   (a benchmark provider's
                                     tile table: triton-resident, -unmirrored, ...; bench/triton_internals.py)
    python bench/kernel_resources.py --kernels symmetric   (triton-symmetric's negatives pass, which
                                                            tests/triton_aot.py plans beside the shipped ones)
--rows: the batch the launches are planned for (a B that is not a multiple of 16 loses Triton's
divisibility hint on the row and column ends, and can change registers and spills).
The SASS count is the whole kernel, both sides of every branch; "wgmma" counts its Hopper
tensor-core instructions (HGMMA)."""
import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.nvidia.compiler import get_ptxas

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import triton_aot  # noqa: E402  (the dispatcher's launches and Triton's launch-time specialisation)
import triton_internals  # noqa: E402  (bench/, this module's folder: the benchmark providers' tile tables)

# the tests' targets, and the T4 (below Triton's supported 8.0; the triton backend refuses it)
ARCHITECTURES = (*triton_aot.TARGETS, 75)


def resources(launch, cc):
    """(registers, spill stores in bytes, SASS instructions, HGMMA instructions) of `launch` on sm_cc."""
    compiled, log = triton_aot.compiled_with_report(launch, cc)
    nvdisasm = os.path.join(os.path.dirname(get_ptxas(cc).path), "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    instructions = sum(1 for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line))
    number = lambda pattern: triton_aot.ptxas_number(log, pattern)  # noqa: E731
    return (number(r"Used (\d+) registers"), number(r"(\d+) bytes spill stores"), instructions,
            len(re.findall(r"\bHGMMA\b", sass)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cc", type=int, default=90, choices=sorted(ARCHITECTURES))
    parser.add_argument("--dtype", default="float16", choices=triton_aot.DTYPES)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--rows", type=int, default=triton_aot.ROWS)
    parser.add_argument("--kernels", nargs="+", default=["negatives", "minpos", "finish", "weights", "grad"],
                        help="name prefixes")
    parser.add_argument("--precision", help="the launches' PRECISION instead of the shipped one (fp16x3: float32's"
                                            " S tiles as float16 products, bench/triton_internals.py)")
    parser.add_argument("--table", choices=sorted(triton_internals.TABLES),
                        help="the tile table of this benchmark provider (bench/triton_internals.py)")
    parser.add_argument("--tiles", nargs="*", default=[],
                        help="BLOCK_M,BLOCK_N,BLOCK_K,warps,stages, each besides the shipped tiles")
    args = parser.parse_args()
    triton_aot.ROWS = args.rows
    if args.table:
        from ms_loss_cuda.triton_kernels import launcher

        launcher.tile_config = triton_internals.TABLES[args.table]()
    print(f"triton {triton.__version__}, sm_{args.cc}, {args.dtype}, D = {args.dim}, mining on"
          + ("" if args.rows == 4096 else f", B = {args.rows}")
          + (f", PRECISION {args.precision}" if args.precision else "") + (f", {args.table}'s tiles" if args.table else ""))
    launches = triton_aot.launches(args.dtype, args.dim, True, False, args.cc)
    unknown = [k for k in args.kernels if not any(name.startswith(k) for name in launches)]
    if unknown:
        parser.error(f"--kernels {' '.join(unknown)}: no launch of that name (the kernels: {', '.join(sorted({n.split('[')[0] for n in launches}))})")
    for name, shipped in launches.items():
        if not name.startswith(tuple(args.kernels)):
            continue
        for tiles in [None] + [tuple(int(v) for v in t.split(",")) for t in args.tiles]:
            launch = shipped
            if args.precision:
                launch = launch._replace(constexprs=dict(launch.constexprs, PRECISION=args.precision))
            if tiles:
                block_m, block_n, block_k, warps, stages = tiles
                launch = launch._replace(constexprs=dict(launch.constexprs, BLOCK_M=block_m, BLOCK_N=block_n,
                                                         BLOCK_K=block_k), num_warps=warps, num_stages=stages,
                                         max_registers=None)  # (the shipped cap is for the shipped warps)
            c = dict(launch.constexprs)
            c.setdefault("BLOCK_M", c.get("BLOCK"))  # (symmetric_negatives_kernel's square tiles)
            c.setdefault("BLOCK_N", c.get("BLOCK"))
            if c["BLOCK_M"] is None:  # (the row kernels: blocks of rows and of D)
                tile = " x ".join(str(v) for k, v in c.items() if k.startswith("BLOCK_") and v is not None)
            else:
                depth = f" (rows of {c['RESIDENT_D']} kept)" if c.get("RESIDENT_D") else f" x {c['BLOCK_K']}"
                depth += f" x {c['COLUMN_TILES']} a program" if c.get("COLUMN_TILES", 1) > 1 else ""
                tile = f"{c['BLOCK_M']} x {c['BLOCK_N']}{depth}"
            shape = (f"{tile}, {launch.num_warps} warps, {launch.num_stages} stages"
                     + (f", {launch.max_registers} at most" if launch.max_registers else ""))
            registers, spills, instructions, wgmma = resources(launch, args.cc)
            print(f"{name:95s} {shape:34s} {registers:4d} registers {spills:4d} B spilled {instructions:6d} SASS"
                  f" {wgmma:4d} wgmma", flush=True)


if __name__ == "__main__":
    main()
