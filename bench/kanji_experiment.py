"""What larger batches and memories buy: the kanji experiment, one run of the training command per setting.

The data is SOP's protocol on KanjiVG drawings: train on half of the 6,703 characters, retrieve among
the unseen other half (3,352 classes, 16,760 drawings). Every run is the built-in convnet (128-d
embedding), Adam at 1e-3 with a cosine schedule, M = 4 samples per class; Recall@1, Recall@10 and
MAP@R are measured on the unseen classes.

Two protocols:
- fixed-steps (the MS paper's, its supplementary Table 2): every setting trains the same number of
  steps with the same schedule, so a larger batch sees more images. Batches of 32 to 2048 (8192 with
  --with-8192, through gradient caching), and batch 128 with cross-batch memories of 4096 and 16384
  (used after the first tenth of the steps); each setting with every seed of --seeds.
- equal-images: every setting sees the same number of images (--images), so a larger batch makes
  fewer updates: how to spend a fixed budget of compute.
Writes results.json, results.md (the tables) and recall.png under --out; experiment_report.py makes
the tables and the plot. --device cuda runs the GPU version (larger batches and memories, and the
loss alone timed against pytorch-metric-learning and torch.compile at each size: experiment_gpu.py).

    python bench/kanji_experiment.py --out bench/results/experiment/fixed-steps        # make experiment
    python bench/kanji_experiment.py --protocol equal-images --out bench/results/experiment/equal-images
"""
import argparse
import json
import os
import time

from benchmark import require_device
from experiment_report import write_report
from experiment_runs import machine_info, run_settings

# name: (batch, training command arguments); fixed-steps on CPU, sized to finish within 90 minutes on 2 cores
FIXED_STEPS = {
    "batch 32": (32, []),
    "batch 128": (128, []),
    "batch 512": (512, []),
    "batch 2048": (2048, []),
    "batch 128 + memory 4096": (128, ["--memory-size", "4096"]),
    "batch 128 + memory 16384": (128, ["--memory-size", "16384"]),
}
BATCH_8192 = {"batch 8192 (chunks of 1024)": (8192, ["--chunk-size", "1024"])}
EQUAL_IMAGES = {
    "batch 64": (64, []),
    "batch 512": (512, []),
    "batch 4096 (chunks of 512)": (4096, ["--chunk-size", "512"]),
    "batch 256 + memory 16384": (256, ["--memory-size", "16384"]),
}


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", choices=("fixed-steps", "equal-images"), default="fixed-steps")
    parser.add_argument("--out", help="default: bench/results/experiment/PROTOCOL, on cuda bench/results/experiment-gpu")
    parser.add_argument("--data", default="bench/results/experiment/data", help="the kanji render cache")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=300, help="fixed-steps: the steps of every setting")
    parser.add_argument("--images", type=int, default=307200, help="equal-images: the images of every setting")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--evaluations", type=int, default=0,
                        help="evaluations besides the untrained and the final one (0: none)")
    parser.add_argument("--jobs", type=int, default=1, help="training runs at once (a GPU: several)")
    parser.add_argument("--with-8192", action="store_true", help="fixed-steps: also batch 8192 (gradient caching)")
    parser.add_argument("--settings", nargs="+", help="run only these settings (names as in the table)")
    parser.add_argument("--report", metavar="RESULTS_JSON", help="only remake the tables and plot of a finished run")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more training command arguments")
    return parser


def main():
    parser = build_parser()
    args = parser.parse_args()
    if args.report:
        with open(args.report) as handle:
            done = json.load(handle)
        out = os.path.dirname(os.path.abspath(args.report))
        text = write_report(done["info"], done["runs"], out)
        if "loss" in done:  # (a GPU run's: the loss alone timed at its sizes)
            from experiment_gpu import append_loss_table

            text += "\n" + append_loss_table(done["loss"], done["info"]["device"], out)
        return print(text)
    if args.out is None:
        args.out = ("bench/results/experiment-gpu" if args.device == "cuda" else
                    os.path.join("bench/results/experiment", args.protocol))
    if args.device == "cuda":
        require_device(parser, args.device)  # (before the data is rendered)
        from experiment_gpu import main as gpu_main

        return gpu_main(args)
    settings = dict(FIXED_STEPS, **(BATCH_8192 if args.with_8192 else {})) if args.protocol == "fixed-steps" \
        else EQUAL_IMAGES
    if args.settings:
        unknown = sorted(set(args.settings) - set(settings))
        if unknown:
            parser.error(f"unknown settings {unknown}; choose from {list(settings)}")
        settings = {name: settings[name] for name in args.settings}
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    runs = run_settings(settings, lambda batch: args.steps if args.protocol == "fixed-steps" else args.images // batch,
                        args)
    info = dict(machine_info(args.device), protocol=args.protocol, wall_minutes=round((time.perf_counter() - started)
                                                                                      / 60, 1))
    info.update(steps=args.steps) if args.protocol == "fixed-steps" else info.update(images=args.images)
    with open(os.path.join(args.out, "results.json"), "w") as handle:
        json.dump({"info": info, "runs": runs}, handle, indent=1)
    print(write_report(info, runs, args.out))


if __name__ == "__main__":
    main()
