"""Compiles every Triton kernel launch the dispatcher makes, ahead of time for sm_80 and sm_90
(no GPU or driver needed), and the float16 and float32 launches at D = 512 for Blackwell, sm_100
(B200) and sm_120 (RTX 50), besides the self case's negatives pass of the benchmark's triton-symmetric
and triton-unsymmetric (D = 512), and prints one JSON record per (launch, target): tensor-core
instructions in the PTX, what `ptxas -v` reports of the cubin Triton assembled (its own run, with its
flags: Triton 3.9's register allocation level spills where ptxas's default does not) and the shared
memory a program needs. Run by tests/test_triton_compile.py in a process of its own, because
TRITON_INTERPRET=1 (set for the interpreted tests) replaces the jit functions this needs.

A cold compile of every launch takes about nine CPU-minutes, half the suite's CPU time, so by
default sm_80 gets only the float16 and float32 launches with mining on (at every D, so every sm_80
entry of the tile table: Ampere's instructions and its smaller shared memory), and the other
targets every launch; `--all` (`make compile-check`) adds sm_80's bfloat16, TF32 and mining-off
launches. Run it after changing a kernel or a tile.
Usage: python tests/triton_aot.py [--all]
"""
import contextlib
import functools
import io
import itertools
import json
import multiprocessing
import os
import re
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from unittest import mock

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.cache import get_cache_manager

from ms_loss_cuda.triton_kernels import backward_plan, forward_plan, launcher
from ms_loss_cuda.triton_kernels.launcher import Launch
from ms_loss_cuda.triton_kernels.row_kernels import row_norms_plan, stored_rows_plan, unit_rows_grad_plan, unit_rows_plan

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from triton_internals import symmetric_tiles, unsymmetric_tiles  # noqa: E402

TARGETS = (80, 90, 100, 120)  # compute capabilities
BLACKWELL = (100, 120)  # compiled for the float16 and float32 launches at D = 512 only
POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int64: "*i64",
                 torch.int32: "*i32"}
DIMS = (3, 32, 64, 130, 512)  # every (BLOCK_K, BLOCK_D) the table gives, with and without divisibility by 16
ROW_KERNEL_DIMS = (130, 512)  # the row kernels: a masked and a whole block of columns
PLAN_ROW_KERNELS = ("label_order_kernel", "divided_rows_kernel", "split_rows_kernel")  # (the plans' row kernels: at those D only)
ROWS, REF_ROWS = 4096, 1000


DTYPES = ("float16", "bfloat16", "float32", "float32-tf32")  # float32 under matmul precision "highest" and "high"
TF32_DIMS = (32, 130, 512)


def launches(dtype_name, dim, mining, skip, cc):
    """The dispatcher's launches (GPU configurations of compute capability cc) for the self and the
    reference-set case (float16: also a bank compared through its norms), with the fused and the
    chunked backward (its cuBLAS products left out), and the normalisation's row kernels."""
    torch.set_float32_matmul_precision("high" if dtype_name.endswith("-tf32") else "highest")
    dtype = getattr(torch, dtype_name.split("-")[0])
    x, labels = torch.randn(ROWS, dim, dtype=dtype), torch.randint(0, 100, (ROWS,))
    ref, ref_labels = torch.randn(REF_ROWS, dim, dtype=dtype), torch.randint(0, 100, (REF_ROWS,))
    hyper = (2.0, 50.0, 0.5, 0.1, mining, skip)
    found = {}
    if dim in ROW_KERNEL_DIMS and not dtype_name.endswith("-tf32") and mining and not skip:
        y, norm, _, normalize = unit_rows_plan(x)
        found.update((launch.kernel.fn.__name__, launch) for launch in normalize + unit_rows_grad_plan(x, y, norm)[1])
        found["unit_rows_kernel[norms]"] = row_norms_plan(x)[-1][0]  # (a bank's norms alone)
        # the eager loss's: the backward's float32 rows, the chunked one's padded and in label order, into
        # the input's dtype ("none") or into float32 (the gradient its forward makes for "mean" and "sum")
        padded, order = torch.zeros(ROWS, dim + 16, dtype=torch.float32), torch.arange(ROWS, dtype=torch.int32)
        for out, suffix in ((None, ""), (torch.float32, "[to_float32]")):
            found["unit_rows_grad_kernel[ordered]" + suffix] = unit_rows_grad_plan(padded, y, norm, order, out)[1][0]
            found["unit_rows_grad_kernel[float32]" + suffix] = unit_rows_grad_plan(padded, y, norm, None, out)[1][0]
        # CrossBatchMemory's store: the rows into a memory of their dtype, int64 labels and ids into int64 ones
        keys, slots = torch.arange(ROWS), torch.arange(ROWS)
        found["stored_rows_kernel"] = stored_rows_plan(y, keys, keys, slots, y, keys, keys)[1][0]
    cases = [("self", None, None, None, None), ("ref", None, ref, ref_labels, None)]
    if dim == DIMS[-1]:  # the self case with the caller's identities (its kernels' variants that may compare
        # them, behind a flag: the same tiles as without) at one D, which keeps the compile checks' time down
        cases.append(("self", torch.arange(ROWS) % 97, None, None, None))
    if dtype == torch.float16:  # a bank of float16 rows as they are, compared through its norms
        cases.append(("ref", None, ref, ref_labels, torch.ones(2, REF_ROWS)))
    for case, i, r, rl, ref_norms in cases:
        capability = divmod(cc, 10)
        _, stats, forward = forward_plan(x, labels, i, r, rl, None, *hyper, interpret=False, capability=capability,
                                         ref_norms=ref_norms)
        bank = dict(ref_norms=ref_norms, ref_grad=ref_norms is None)
        if r is None:  # the label order label_order_kernel would write, which the backward's plan reads
            order = torch.sort(labels, stable=True).indices
            ranks = torch.searchsorted(labels[order], labels[order])
            stats[4:].view(torch.int32).copy_(torch.stack([order, ranks]))
        with mock.patch.dict(os.environ, MS_LOSS_TRITON_CHUNK_MB="0"):  # the fused backward (a GPU's default: chunked)
            *_, backward = backward_plan(torch.ones(ROWS), stats, x, labels, i, r, rl, None, *hyper, interpret=False,
                                         capability=capability, **bank)
        chunked = []
        # (float32 unit rows under "highest": the products' float16 pieces, at the row kernels' D)
        unit_rows = (False, True) if dtype_name == "float32" and dim in ROW_KERNEL_DIMS else (False,)
        for mib, unit in ((mib, unit) for mib in ("64", "16") for unit in unit_rows):
            # (self case: one chunk of whole rows; the triangle's chunks of 2048 or 1024 rows)
            with mock.patch.dict(os.environ, MS_LOSS_TRITON_CHUNK_MB=mib):
                for ref_grad in (True, False) if ref_norms is None else (False,):
                    # (without: the eager loss's one gradient for all anchors, "mean")
                    grad = torch.ones(ROWS) if ref_grad else torch.ones(1).expand(ROWS)
                    chunked += backward_plan(grad, stats, x, labels, i, r, rl, None, *hyper, ref_grad=ref_grad,
                                             interpret=False, capability=capability, grad_divisor=ROWS,
                                             ref_norms=ref_norms, unit_rows=unit)[-1]
        for launch in forward + backward + chunked:
            if not isinstance(launch, Launch) or (launch.kernel.fn.__name__ in PLAN_ROW_KERNELS
                                                  and dim not in ROW_KERNEL_DIMS):
                continue
            found.setdefault(launch_name(launch), launch)  # (the launches the cases share are compiled once)
    if dtype_name in ("float16", "float32") and dim == DIMS[-1]:
        # the self case's negatives pass of the benchmark's triton-symmetric (float32: sm_90's alone,
        # symmetric_tiles says why) and triton-unsymmetric (where the shipped table is symmetric)
        for table, i in itertools.product((symmetric_tiles, unsymmetric_tiles), (None, torch.arange(ROWS) % 97)):
            with mock.patch.object(launcher, "tile_config", table(launcher.tile_config)):
                *_, forward = forward_plan(x, labels, i, None, None, None, *hyper, interpret=False,
                                           capability=divmod(cc, 10))
            for launch in forward:
                if launch.kernel.fn.__name__.endswith("negatives_kernel"):
                    found.setdefault(launch_name(launch), launch)
    return found


def launch_name(launch):
    """The kernel's name and the constexprs that make its variants, as the records name a launch."""
    c = launch.constexprs
    name = launch.kernel.fn.__name__ + ("" if "A_ANCHORS" not in c else f"[rows={c['A_ANCHORS']},cols={c['B_ANCHORS']}]")
    name += "" if "COLUMN_LIFT" not in c else f"[column_lift={c['COLUMN_LIFT']}]"
    name += "[half_lift]" if c.get("HALF_LIFT") else ""
    name += "[uniform]" if c.get("UNIFORM") else ""
    name += "" if "w_ptr" not in launch.args else f"[cols={c['B_ANCHORS']},both_lifts={c['BOTH_LIFTS']},copy={c['COPY']}]"
    name += "" if "CHECK_IDS" not in c else f"[check_ids={c['CHECK_IDS']}]"
    name += "" if "SKIP_RANGE" not in c else f"[skip_range={c['SKIP_RANGE']}]"
    name += "[label_order]" if c.get("LABEL_ORDER") else ""
    name += "[mirror]" if c.get("MIRROR") else ""
    name += "[range_tiles]" if c.get("RANGE_TILES") else ""
    name += "[ref_scales]" if c.get("REF_SCALES") or c.get("B_SCALES") else ""
    name += "[split]" if c.get("SPLIT") else ""
    name += "[undivided]" if c.get("DIVIDE") is False else ""
    return name


def signature(launch):
    """Triton's launch-time specialisation: pointers and multiples of 16 get divisibility hints."""
    sig, attrs = {}, {}
    for i, name in enumerate(launch.kernel.arg_names):
        if name in launch.constexprs:
            sig[name] = "constexpr"
            continue
        value = launch.args[name]
        if isinstance(value, torch.Tensor):
            sig[name], attrs[(i,)] = POINTER_TYPES[value.dtype], [["tt.divisibility", 16]]
        elif isinstance(value, int):
            sig[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return sig, attrs


@functools.lru_cache(maxsize=1)  # (the jobs of one group arrive together: chunks of pool.map)
def group_launches(dtype_name, dim, mining, skip, cc):
    return launches(dtype_name, dim, mining, skip, cc)


def compile_key(launch, cc):
    """What triton.compile sees of a launch: launches with equal keys compile to the same binary."""
    sig, attrs = signature(launch)
    return json.dumps([launch.kernel.fn.__name__, sig, sorted(map(str, attrs)), launch.constexprs, launch.options,
                       cc], sort_keys=True, default=str)


PTXAS_REPORT = "ptxas-v.log"  # kept in each of Triton's cache entries that this module compiles


def compiled_with_report(launch, cc):
    """(`launch` compiled by Triton for compute capability cc, the `ptxas -v` report of its cubin). The
    report is that of Triton's own ptxas run, with its flags (line info, register allocation level), and
    is kept in Triton's cache entry beside the cubin, so that a cached kernel is not assembled again; a
    kernel cached without a report is compiled again in a scratch cache (Triton's may be read-only)."""
    sig, attrs = signature(launch)
    compile = functools.partial(triton.compile, ASTSource(launch.kernel, sig, constexprs=dict(launch.constexprs),
                                                          attrs=attrs),
                                target=GPUTarget("cuda", cc, 32), options=launch.options)
    with knobs.nvidia.scope(), contextlib.redirect_stdout(io.StringIO()) as printed:
        knobs.nvidia.dump_ptxas_log = True  # (printed, as Triton runs ptxas)
        compiled = compile()
        cache = get_cache_manager(compiled.hash)
        kept = _kept_report(cache)
        report = kept or _report(printed.getvalue())
        if report is None:
            with knobs.cache.scope(), tempfile.TemporaryDirectory() as scratch:
                knobs.cache.dir = scratch
                compile()
            report = _report(printed.getvalue())
    if report is None:
        raise RuntimeError(f"Triton printed no ptxas report for {launch_name(launch)} on sm_{cc}")
    if kept is None:
        try:
            cache.put(report, PTXAS_REPORT, binary=False)
        except OSError:  # (a read-only cache: the next run compiles it again)
            pass
    return compiled, report


def _kept_report(cache):
    """The report kept in a Triton cache entry (`PTXAS_REPORT`); None where there is none, or no report."""
    path = cache.get_file(PTXAS_REPORT)
    if path is None:
        return None
    with open(path) as f:
        return _report(f.read())


def _report(text):
    """`text` if it holds a ptxas -v report (a kernel's registers), else None."""
    return text if re.search(r"Used \d+ registers", text) else None


def ptxas_number(report, pattern):
    """The number `pattern` (one group) reads in a ptxas report."""
    return int(re.search(pattern, report).group(1))


def compile_facts(job):
    """The compiled launch `job` names: tensor-core instructions, shared memory and ptxas's report."""
    dtype_name, dim, mining, skip, name, cc = job
    launch = group_launches(dtype_name, dim, mining, skip, cc)[name]
    compiled, log = compiled_with_report(launch, cc)
    ptx = compiled.asm["ptx"]
    return dict(config=dict(launch.constexprs, **launch.options),
                wgmma="wgmma.mma_async" in ptx, mma_sync="mma.sync" in ptx, tcgen05="tcgen05.mma" in ptx,
                tf32=".tf32" in ptx, tf32x3="cvt.rna.tf32" in ptx,  # (the operands split into TF32 high and low parts)
                shared=compiled.metadata.shared,
                registers=ptxas_number(log, r"Used (\d+) registers"),
                stack=ptxas_number(log, r"(\d+) bytes stack frame"),
                spill_stores=ptxas_number(log, r"(\d+) bytes spill stores"),
                spill_loads=ptxas_number(log, r"(\d+) bytes spill loads"))


JOB_FIELDS = ("dtype", "dim", "mining", "skip", "kernel", "cc")


def in_suite(dtype, dim, mining, cc):
    """Whether the suite's compile (no --all) takes the group (dtype, D, mining, target)."""
    return cc != 80 or (dtype in ("float16", "float32") and mining)


def jobs(everything=True):
    """(job, compile key) for every launch of every group (dtype, D, mining options, target); the
    suite's groups alone unless `everything`."""
    for dtype in DTYPES:
        for dim in TF32_DIMS if dtype.endswith("-tf32") else DIMS:
            variants = [(True, False)] + ([(False, True)] if dim == DIMS[-1] else [])
            for mining, skip in variants:
                for cc in TARGETS:
                    if cc in BLACKWELL and (dtype not in ("float16", "float32") or dim != DIMS[-1] or not mining):
                        continue
                    if not (everything or in_suite(dtype, dim, mining, cc)):
                        continue
                    for name, launch in group_launches(dtype, dim, mining, skip, cc).items():
                        if name == "minpos_kernel" and not mining:
                            continue  # it has no mining option
                        yield (dtype, dim, mining, skip, name, cc), compile_key(launch, cc)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: ahead-of-time compilation needs the jit functions")
    # one compile per distinct launch (about two thirds of the jobs: the D values share many), its
    # facts recorded for every job that makes it
    groups = {}
    for job, key in jobs(everything="--all" in sys.argv[1:]):
        groups.setdefault(key, []).append(job)
    # spawn, not fork: a forked copy of a process that holds torch's thread pools can deadlock
    with ProcessPoolExecutor(max_workers=os.cpu_count(), mp_context=multiprocessing.get_context("spawn")) as pool:
        for same, facts in zip(groups.values(), pool.map(compile_facts, [same[0] for same in groups.values()],
                                                         chunksize=8)):
            for job in same:
                print(json.dumps(dict(zip(JOB_FIELDS, job), **facts)), flush=True)
