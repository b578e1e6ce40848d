"""The kanji experiment on a GPU (bench/kanji_experiment.py --device cuda): the fixed-steps protocol at
the sizes a GPU reaches in minutes, and the loss alone timed at each of them against the alternatives.

Training (the training command, --amp bf16, --steps each, every seed of --seeds): batch 128, 512,
2048, 8192 and the largest batch the training split holds at M = 4 (its 3,351 classes x 4 = 13,404),
the last two through gradient caching; batch 2048 with memories of 16,384 rows and of the whole
training split, rendered with 12 drawings per class (40,212 rows; every setting trains on that
rendering). A memory takes no rows in its first tenth of the steps, so it must be filled by the
batches after: at 100 steps batch 128 would store only 11,520 rows and leave both memories
part-empty (and alike), batch 2048 fills them after 8 and 20 steps of use. The data is rendered once
before the runs, which --jobs runs at once. Then bench/benchmark.py times one forward + backward of
the loss alone at the same sizes (D = 128, the model's embedding, bfloat16 as under --amp bf16): ours
(triton), pytorch-metric-learning's loss + miner and the dense loss under torch.compile, time and
peak memory.
Writes results.json, results.md, recall.png and loss/ (the benchmark's files) under --out.

    python bench/kanji_experiment.py --device cuda --jobs 14 --out bench/results/experiment-gpu
"""
import json
import os
import subprocess
import sys
import time

from experiment_report import write_report
from experiment_runs import machine_info, run_settings

TRAIN_INSTANCES, TRAIN_CLASSES, PER_CLASS = 12, 3351, 4
WHOLE_SPLIT = TRAIN_INSTANCES * TRAIN_CLASSES
LARGEST = TRAIN_CLASSES * PER_CLASS
SETTINGS = {
    "batch 128": (128, []),
    "batch 512": (512, []),
    "batch 2048": (2048, []),
    "batch 8192 (chunks of 4096)": (8192, ["--chunk-size", "4096"]),
    f"batch {LARGEST} (chunks of 4096)": (LARGEST, ["--chunk-size", "4096"]),
    "batch 2048 + memory 16384": (2048, ["--memory-size", "16384"]),
    f"batch 2048 + memory {WHOLE_SPLIT}": (2048, ["--memory-size", str(WHOLE_SPLIT)]),
}
HERE = os.path.dirname(os.path.abspath(__file__))


def loss_sizes(settings):
    """(batches, memories, the memories' batch) of `settings`, whose loss time_the_loss times: the batches
    against themselves and the memories' batch (one for all, else SystemExit) against the memories."""
    batches = sorted({batch for batch, extra in settings.values() if "--memory-size" not in extra})
    banks = sorted({int(extra[1]) for _, extra in settings.values() if "--memory-size" in extra})
    bank_batches = {batch for batch, extra in settings.values() if "--memory-size" in extra}
    if len(bank_batches) > 1:
        raise SystemExit("the memory settings must share one batch size (the loss is timed at one)")
    return batches, banks, min(bank_batches, default=0)


def time_the_loss(sizes, out, device):
    """bench/benchmark.py at `sizes` (loss_sizes') in bfloat16, D = 128: ours, compiled and pml."""
    batches, banks, bank_batch = sizes
    ours = "triton" if device == "cuda" else "cpu"  # (a CPU run: a smoke test, without the banks)
    command = [sys.executable, os.path.join(HERE, "benchmark.py"), "--device", device, "--dtype", "bfloat16",
               "--dim", "128", "--sizes", *map(str, batches), "--providers", ours, "compiled", "pml",
               "--repeats", "10", "--max-seconds", "5", "--out", os.path.join(out, "loss")]
    if device == "cuda" and banks:
        command += ["--bank", *map(str, banks), "--bank-batch", str(bank_batch)]
    print(f"== the loss alone\n   {' '.join(command)}", flush=True)
    subprocess.run(command, check=True)
    with open(os.path.join(out, "loss", "results.json")) as handle:
        return json.load(handle)["results"]


def append_loss_table(loss, device, out):
    """The loss alone's table (time and peak memory of each provider at each size), appended to
    results.md under `out`; returns it."""
    lines = ["", "The loss alone, bfloat16, D = 128 (ms / peak MiB above the inputs; bench/benchmark.py):", "",
             "| B (x R) | ours | compiled | pml |", "|---|---|---|---|"]
    shapes = sorted({(r["batch"], r["ref"]) for r in loss}, key=lambda shape: (shape[1] or 0, shape[0]))
    for batch, ref in shapes:
        cells = []
        for provider in ("triton" if device == "cuda" else "cpu", "compiled", "pml"):
            found = next((r for r in loss if (r["provider"], r["batch"], r["ref"]) == (provider, batch, ref)), None)
            ok = found is not None and found.get("status") == "ok"
            cells.append(f"{found['seconds'] * 1e3:.3g} ms / {found['peak_extra_mib']:.0f} MiB" if ok else
                         (found or {}).get("status", "-"))
        lines.append(f"| {batch if ref is None else f'{batch} x {ref}'} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "results.md"), "a") as handle:
        handle.write(text)
    return text


def render_once(data, extra):
    """The training split and test set rendered into the cache `data` before runs that start at once: the
    training command's own data loading, with the runs' arguments (`extra`, where the kanji options are)."""
    subprocess.run([sys.executable, "-c", "import sys; from ms_loss_cuda.train.__main__ import load_data; "
                    "from ms_loss_cuda.train.options import parse_args; load_data(parse_args(sys.argv[1:]))",
                    "--data", "kanji", "--root", data, *extra], check=True)


def main(args):
    if args.steps == 300:  # (the CPU protocol's default: a GPU run takes fewer)
        args.steps = 100
    args.extra = ["--amp", "bf16", "--kanji-train-instances", str(TRAIN_INSTANCES), "--eval-batch", "4096",
                  *args.extra]
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    unknown = sorted(set(args.settings or ()) - set(SETTINGS))
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; choose from {list(SETTINGS)}")
    settings = {name: SETTINGS[name] for name in (args.settings or SETTINGS)}
    sizes = loss_sizes(settings)  # (checked before the training)
    render_once(args.data, args.extra)
    runs = run_settings(settings, lambda batch: args.steps, args)
    info = dict(machine_info(args.device), protocol="fixed-steps", steps=args.steps, runs_at_once=args.jobs,
                training_minutes=round((time.perf_counter() - started) / 60, 1))
    results = os.path.join(args.out, "results.json")
    with open(results, "w") as handle:  # (the training's results stand even if the timing fails)
        json.dump({"info": info, "runs": runs}, handle, indent=1)
    loss = time_the_loss(sizes, args.out, args.device)
    info["wall_minutes"] = round((time.perf_counter() - started) / 60, 1)
    with open(results, "w") as handle:
        json.dump({"info": info, "runs": runs, "loss": loss}, handle, indent=1)
    text = write_report(info, runs, args.out) + "\n" + append_loss_table(loss, args.device, args.out)
    print(text)
