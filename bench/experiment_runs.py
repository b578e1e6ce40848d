"""The runs of the training command for the kanji experiment (bench/kanji_experiment.py, experiment_gpu.py),
one after another or several at once, and the machine and build a result file records."""
import concurrent.futures
import json
import os
import platform
import subprocess
import sys
import time

from benchmark import build_name  # (bench/, this module's folder)


def run_folder(name, seed, out):
    """A run's folder under `out`: the setting's name up to its remark in brackets, and the seed."""
    return os.path.join(out, "runs", f"{name.split(' (')[0].replace(' + ', '_').replace(' ', '_')}-seed{seed}")


def run_setting(name, batch, extra, steps, seed, args, log=None):
    """One run of the training command; its metrics history. `log`: a file in the run's folder for the
    command's output (the terminal when None; a failure then prints the file's last lines)."""
    run_dir = run_folder(name, seed, args.out)
    command = [sys.executable, "-m", "ms_loss_cuda.train", "--data", "kanji", "--root", args.data,
               "--steps", str(steps), "--batch-size", str(batch), "--seed", str(seed), "--out", run_dir,
               "--eval-every", str(max(1, steps // args.evaluations)) if args.evaluations else "0",
               "--no-progress", "--device", args.device, *extra, *args.extra]
    if "--memory-size" in extra:
        command += ["--memory-warmup", str(steps // 10)]
    print(f"== {name}, seed {seed}: {steps} steps\n   {' '.join(command)}", flush=True)
    started = time.perf_counter()
    if log is None:
        subprocess.run(command, check=True)
    else:
        os.makedirs(run_dir, exist_ok=True)
        log = os.path.join(run_dir, log)
        with open(log, "w") as handle:
            failed = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT).returncode
        if failed:
            with open(log) as handle:
                tail = "".join(handle.readlines()[-20:])
            raise RuntimeError(f"{name}, seed {seed}: the training command failed (exit {failed}); the end of "
                               f"{log}:\n{tail}")
    with open(os.path.join(run_dir, "metrics.json")) as handle:
        history = json.load(handle)
    return {"batch": batch, "steps": steps, "seed": seed, "wall_seconds": round(time.perf_counter() - started, 1),
            "history": history}


def run_settings(settings, steps_of, args):
    """{name: [each seed's run]} for settings {name: (batch, extra)}; steps_of(batch) gives a run's
    steps. With args.jobs > 1 that many runs go at once, each logging to its run folder's log.txt: on
    a GPU a small model leaves the device mostly idle, so concurrent runs fill it (their wall_seconds
    then count the sharing)."""
    jobs = [(name, batch, extra, seed) for name, (batch, extra) in settings.items() for seed in args.seeds]
    folders = [run_folder(name, seed, args.out) for name, _, _, seed in jobs]
    if len(set(folders)) < len(folders):
        raise ValueError(f"two runs would share a folder: {sorted(f for f in folders if folders.count(f) > 1)}")
    if args.jobs <= 1:
        done = [run_setting(name, batch, extra, steps_of(batch), seed, args) for name, batch, extra, seed in jobs]
    else:  # (the first failure cancels the runs not started and is raised once the running ones end)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(run_setting, name, batch, extra, steps_of(batch), seed, args, "log.txt")
                       for name, batch, extra, seed in jobs]
            for future in concurrent.futures.as_completed(futures):
                if future.exception() is not None:
                    pool.shutdown(cancel_futures=True)
                    raise future.exception()
        done = [future.result() for future in futures]
    runs = {name: [] for name in settings}
    for (name, *_), run in zip(jobs, done):
        runs[name].append(run)
    return runs


def machine_info(device):
    import torch

    info = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "device": device,
            "date": time.strftime("%Y-%m-%d")}
    info["build"] = build_name()
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info
