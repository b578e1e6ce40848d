"""The triton backend's direct launches (launcher.Launch) run the kernel Triton's own launch would.

A Launch whose arguments specialise as an earlier one's calls that compiled kernel's launcher itself,
keyed by launcher.Launch._key, which must tell apart every pair of launches that Triton compiles
apart (dtypes, 16-byte alignment, integers equal to 1 or divisible by 16, constexprs, warps, stages).
Without a GPU: in a process without the interpreter, the GPU's plans run on CPU tensors through
Triton's launch path down to a stand-in driver (bench/host_time.py's, each kernel compiled for
sm_90); every launch whose key was seen before is also given to Triton's launch path, which must
return the same compiled kernel. Steps of float16 and float32, the self case and a memory bank, D
aligned or not, integers that are 1 or not.
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(os.path.dirname(HERE), "bench")


def test_a_direct_launch_runs_the_kernel_tritons_launch_picks():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    checked = json.loads(done.stdout.strip().splitlines()[-1])
    assert checked["launches"] >= 40, checked
    assert {"minpos_kernel", "negatives_kernel", "finish_kernel", "scales_kernel", "weights_kernel",
            "unit_rows_kernel", "unit_rows_grad_kernel", "label_order_kernel"} <= set(checked["kernels"]), checked


def main():
    """The worker: steps through the stand-in, each direct launch checked against Triton's launch path;
    prints how many launches (and which kernels) were checked."""
    sys.path.insert(0, BENCH)
    import host_time

    host_time.cpu_stand_in("launcher")
    import torch
    from benchmark import HARDNESS, make_inputs, step_function
    from ms_loss_cuda.triton_kernels import launcher

    stand_in, launches, kernels = launcher.Launch.__call__, [], set()

    def checked(launch):
        stand_in(launch)
        known = launcher._compiled_kernels.get(launch._key())
        if known is None:  # (its first launch: Triton's path made the entry)
            return
        picked = launch.kernel[launch.grid](**launch.args, **launch.constexprs, **launch.options)
        assert known[0] is picked, f"{launch.kernel.fn.__name__}: the direct launch's kernel is not Triton's"
        launches.append(launch)
        kernels.add(launch.kernel.fn.__name__)

    launcher.Launch.__call__ = checked
    # (1 and 3 anchors: integer arguments that differ only in being 1)
    for dtype, batch, dim, ref_rows in ((torch.float16, 128, 128, None), (torch.float16, 97, 130, 300),
                                        (torch.float16, 1, 130, 300), (torch.float16, 3, 130, 300),
                                        (torch.float32, 64, 32, None)):
        x, labels, ref, ref_labels = make_inputs(batch, dim, HARDNESS["typical"], ref_rows, "cpu")
        x, ref = x.to(dtype).requires_grad_(), None if ref is None else ref.to(dtype)
        step = step_function("triton-direct", labels, ref, ref_labels)
        for _ in range(2):
            x.grad = None
            step(x)
    print(json.dumps({"launches": len(launches), "kernels": sorted(kernels)}))


if __name__ == "__main__":
    main()
