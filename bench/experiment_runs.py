"""One run of the training command for the kanji experiment (bench/kanji_experiment.py, experiment_gpu.py),
and the machine and build a result file records."""
import json
import os
import platform
import subprocess
import sys
import time

from benchmark import build_name  # (bench/, this module's folder)


def run_setting(name, batch, extra, steps, seed, args):
    """One run of the training command; its metrics history."""
    run_dir = os.path.join(args.out, "runs", f"{name.split(' (')[0].replace(' + ', '_').replace(' ', '_')}-seed{seed}")
    command = [sys.executable, "-m", "ms_loss_cuda.train", "--data", "kanji", "--root", args.data,
               "--steps", str(steps), "--batch-size", str(batch), "--seed", str(seed), "--out", run_dir,
               "--eval-every", str(max(1, steps // args.evaluations)) if args.evaluations else "0",
               "--no-progress", "--device", args.device, *extra, *args.extra]
    if "--memory-size" in extra:
        command += ["--memory-warmup", str(steps // 10)]
    print(f"== {name}, seed {seed}: {steps} steps\n   {' '.join(command)}", flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True)
    with open(os.path.join(run_dir, "metrics.json")) as handle:
        history = json.load(handle)
    return {"batch": batch, "steps": steps, "seed": seed, "wall_seconds": round(time.perf_counter() - started, 1),
            "history": history}


def machine_info(device):
    import torch

    info = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "device": device,
            "date": time.strftime("%Y-%m-%d")}
    info["build"] = build_name()
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info
