"""Train an embedding with the fused MS loss: python -m ms_loss_cuda.train --help (or ms-loss-train).

One process, or several with torchrun (`torchrun --nproc-per-node 8 -m ms_loss_cuda.train ...`):
each process takes its share of every global P x M batch, the loss is the MS loss of the global
batch (ms_loss_cuda.distributed) and DistributedDataParallel averages the gradients. --chunk-size
turns on embedding-gradient caching, so the batch is limited by the [B, D] embeddings, not by the
activations. Rank 0 prints the sizes of the train and test sets, shows a progress bar, evaluates on
the held-out classes every --eval-every steps and writes OUT/metrics.json, OUT/metrics.csv,
OUT/recall.png and OUT/checkpoint.pt (plain data: --resume loads it with weights_only=True).
"""
import argparse
import contextlib
import csv
import datetime
import importlib.util
import json
import math
import os
import time

import torch
import torch.distributed as dist

# The command's own dependencies, the [train] extras (kanjivg, data only, is checked where the kanji
# data is read): a clear message up front rather than a failure part-way through a run.
_MISSING = [package for module, package in (("numpy", "numpy"), ("PIL", "pillow"), ("matplotlib", "matplotlib"),
                                            ("tqdm", "tqdm")) if importlib.util.find_spec(module) is None]
if _MISSING:
    raise ImportError(f"the training command needs {', '.join(_MISSING)}, which "
                      f"{'is' if len(_MISSING) == 1 else 'are'} not installed: pip install \"ms-loss-cuda[train]\"")

import ms_loss_cuda  # noqa: E402
from ms_loss_cuda import distributed, evaluation, gradient_cache, reference  # noqa: E402
from ms_loss_cuda.common import check_hyper_parameters  # noqa: E402
from ms_loss_cuda.train import checkpoint, data, kanji, models  # noqa: E402

DATA_SETS = ("kanji", "sop", "folders", "features")


def _option(group, *names, shown=None, **options):
    """group.add_argument, with the default appended to the help line: "(default: X)", X = `shown`
    where the value is worked out later (a None default), else the default itself."""
    action = group.add_argument(*names, **options)
    if shown is None:
        if action.default is None:
            raise ValueError(f"{names[0]}: a None default needs `shown`, the default in words")
        value = action.default
        shown = ("off" if not value else "on") if isinstance(value, bool) else (
            " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value))
    action.help = f"{action.help} (default: {shown.replace('%', '%%')})"
    return action


def build_parser():
    """The command's argument parser: every option has a help line that ends with its default."""
    p = argparse.ArgumentParser(prog="python -m ms_loss_cuda.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    _option(g, "--data", choices=DATA_SETS, default="kanji",
            help="kanji: rendered KanjiVG characters (offline); sop: ROOT/Ebay_{train,test}.txt; "
                 "folders: ROOT/train/<class>/* and ROOT/test/<class>/*; features: --train-features ...")
    _option(g, "--root", help="data root (sop, folders); the render cache for kanji",
            shown="none for sop and folders, which need it; OUT/../data for kanji")
    _option(g, "--train-features", help="features: .npy/.pt [N, D] (or a .pt dict with features and labels)",
            shown="none; --data features needs it")
    _option(g, "--train-labels", help="features: .npy/.pt [N]", shown="none: the labels of a .pt dict")
    _option(g, "--test-features", help="features: the test set, as --train-features",
            shown="none; --data features needs it")
    _option(g, "--test-labels", help="features: the test labels, as --train-labels",
            shown="none: the labels of a .pt dict")
    _option(g, "--kanji-classes", type=int, help="kanji: use this many characters", shown="all: 6,703")
    _option(g, "--kanji-train-instances", type=int, default=8, help="drawings per training class")
    _option(g, "--kanji-test-instances", type=int, default=5, help="drawings per test class")
    _option(g, "--kanji-jitter", type=float, default=1.8, help="how far drawings of a class differ")
    _option(g, "--image-size", type=int, help="crop size", shown="224 for images, 32 for kanji")
    _option(g, "--workers", type=int, default=4, help="image decoding processes (sop, folders)")
    g = p.add_argument_group("model")
    _option(g, "--backbone", help="convnet (built in), a torchvision model name (resnet50, ...), or linear/mlp "
                                  "for features", shown="convnet for images, linear for features")
    _option(g, "--weights", help="local state_dict file for the torchvision backbone (nothing is downloaded)",
            shown="none: random initial weights")
    _option(g, "--width", type=int, default=32, help="convnet: channels of its first block")
    _option(g, "--hidden", type=int, default=512, help="mlp: hidden units")
    _option(g, "--dim", type=int, default=128, help="embedding size")
    _option(g, "--freeze-bn", action="store_true", help="batch-norm statistics fixed, as the MS authors train")
    g = p.add_argument_group("batches and optimisation")
    _option(g, "--batch-size", type=int, default=256, help="global batch (all processes together)")
    _option(g, "--per-class", type=int, default=4, help="M: samples per class in a batch")
    _option(g, "--steps", type=int, default=1000, help="optimisation steps (batches) of the whole run")
    _option(g, "--chunk-size", type=int, default=0,
            help="embedding-gradient caching: encode this many samples at a time (0: the whole batch)")
    _option(g, "--optimizer", choices=("adam", "adamw", "sgd"), default="adam",
            help="the optimiser (sgd with momentum 0.9)")
    _option(g, "--lr", type=float, default=1e-3, help="peak learning rate")
    _option(g, "--weight-decay", type=float, default=5e-4, help="the optimiser's weight decay")
    _option(g, "--schedule", choices=("constant", "step", "cosine"), default="cosine",
            help="learning-rate schedule over --steps")
    _option(g, "--milestones", type=float, nargs="*", default=(0.4, 0.8), help="step schedule: fractions of --steps")
    _option(g, "--gamma", type=float, default=0.1, help="step schedule: factor at each milestone")
    _option(g, "--warmup-steps", type=int, default=0, help="linear learning-rate warm-up")
    _option(g, "--amp", choices=("off", "bf16", "fp16"), default="off", help="mixed precision, on CUDA")
    _option(g, "--device", help="the device to train on", shown="the local rank's GPU when cuda is available, else cpu")
    _option(g, "--seed", type=int, default=0, help="seeds the weights, the batches and the augmentations")
    g = p.add_argument_group("loss (ms_loss_cuda.multi_similarity_loss)")
    _option(g, "--alpha", type=float, default=2.0, help="positive-pair scale")
    _option(g, "--beta", type=float, default=50.0, help="negative-pair scale")
    _option(g, "--base", type=float, default=0.5, help="similarity margin (lambda)")
    _option(g, "--epsilon", type=float, default=0.1, help="pair-mining margin")
    _option(g, "--no-mining", dest="mining", action="store_false", help="turn pair mining off",
            shown="mining on")
    _option(g, "--skip-incomplete-anchors", action="store_true",
            help="zero the anchors whose mined positive or negative set is empty, as the authors' code does")
    _option(g, "--backend", default="auto", choices=ms_loss_cuda.loss.BACKENDS,
            help="the loss's implementation (auto: the first that runs on the device)")
    _option(g, "--memory-size", type=int, default=0, help="cross-batch memory rows (0: none)")
    _option(g, "--memory-weight", type=float, default=1.0, help="weight of the batch-against-memory loss term")
    _option(g, "--memory-warmup", type=int, default=0, help="steps before the memory is used")
    g = p.add_argument_group("evaluation and output")
    _option(g, "--out", default="runs/train", help="output folder: metrics, plot and checkpoint")
    _option(g, "--eval-every", type=int, default=0, help="steps between evaluations (0: only before and after)")
    _option(g, "--eval-batch", type=int, default=1024, help="images embedded at a time for evaluation")
    _option(g, "--ks", type=int, nargs="+", default=(1, 10, 100, 1000),
            help="Recall@K's K, leave-one-out on the test set: each at most the test set's size - 1")
    _option(g, "--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at evaluations)")
    _option(g, "--resume", action="store_true", help="continue from OUT/checkpoint.pt when it exists")
    _option(g, "--no-progress", action="store_true", help="no progress bar")
    return p


def _check_numbers(parser, args):
    """parser.error for a count or a rate the run cannot use, and for the loss's hyper-parameters that
    the loss would refuse at its first call."""
    least = dict(steps=1, dim=1, width=1, hidden=1, eval_batch=1, image_size=1, workers=0, chunk_size=0,
                 warmup_steps=0, eval_every=0, checkpoint_every=0, memory_size=0, memory_warmup=0)
    for name, value in least.items():
        if getattr(args, name) is not None and getattr(args, name) < value:
            parser.error(f"--{name.replace('_', '-')} must be at least {value}, got {getattr(args, name)}")
    rates = dict(lr=(args.lr, False), weight_decay=(args.weight_decay, True), gamma=(args.gamma, False),
                 memory_weight=(args.memory_weight, True))
    for name, (value, zero) in rates.items():
        if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
            parser.error(f"--{name.replace('_', '-')} must be a finite number {'>= 0' if zero else '> 0'}, got {value}")
    try:
        check_hyper_parameters(args.alpha, args.beta, args.base, args.epsilon, "mean")
    except ValueError as error:
        parser.error(f"--{error}")


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.ks) < 1:
        parser.error(f"--ks: every k must be at least 1, got {' '.join(map(str, args.ks))}")
    if args.per_class < 2:
        parser.error(f"--per-class must be at least 2, got {args.per_class}: a class of one sample has no positive pair")
    if args.batch_size < 1 or args.batch_size % args.per_class:
        parser.error(f"--batch-size ({args.batch_size}) must be a positive multiple of --per-class "
                     f"({args.per_class}): a batch is classes of --per-class samples each")
    _check_numbers(parser, args)
    if args.backbone is None:
        args.backbone = "linear" if args.data == "features" else "convnet"
    if args.image_size is None:
        args.image_size = 32 if args.data == "kanji" else 224
    return args


# ---- setup ----------------------------------------------------------------------------------------
def init_processes(args):
    """(rank, world size, device); torchrun's environment starts the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA GPU")
    if args.amp != "off" and device.type != "cuda":
        raise SystemExit(f"--amp {args.amp} is mixed precision on CUDA; on {device.type} pass --amp off")
    if device.type == "cuda":
        if world > 1 and device.index is not None:
            raise SystemExit("under torchrun every process takes its LOCAL_RANK's GPU: pass --device cuda, no index")
        device = torch.device("cuda", local if device.index is None else device.index)
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        # the other ranks wait at a barrier while rank 0 evaluates: allow long evaluations
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=2))
    return (dist.get_rank(), world, device) if world > 1 else (0, 1, device)


class TensorData:
    """Samples already in memory (kanji drawings, features): a batch is one indexing."""

    def __init__(self, inputs, labels):
        self.inputs, self.labels = inputs, labels

    def __len__(self):
        return len(self.labels)

    def batch(self, indices):
        inputs = self.inputs[indices]
        if inputs.dtype == torch.uint8:  # kanji drawings -> [B, 1, H, W] in [-1, 1]
            inputs = inputs[:, None].float() / 127.5 - 1.0
        return inputs, self.labels[indices]


def load_data(args):
    """(train, test): TensorData or data.ImageDataset each."""
    if args.data == "kanji":
        cache = args.root or os.path.join(os.path.dirname(os.path.abspath(args.out)), "data")
        sets = kanji.load(cache, train_per_class=args.kanji_train_instances, test_per_class=args.kanji_test_instances,
                          size=args.image_size, jitter=args.kanji_jitter, classes=args.kanji_classes)
        return [TensorData(torch.from_numpy(x), torch.from_numpy(y)) for x, y in (sets["train"], sets["test"])]
    if args.data == "features":
        if not (args.train_features and args.test_features):
            raise SystemExit("--data features needs --train-features and --test-features")
        try:
            return [TensorData(*data.read_features(f, l)) for f, l in ((args.train_features, args.train_labels),
                                                                       (args.test_features, args.test_labels))]
        except (ValueError, FileNotFoundError) as error:  # (a missing file, or one that holds no features or labels)
            raise SystemExit(str(error)) from None
    if not args.root:
        raise SystemExit(f"--data {args.data} needs --root")
    try:
        if args.data == "sop":
            splits = [data.read_sop(args.root, split) for split in ("train", "test")]
        else:
            splits = [data.read_folders(os.path.join(args.root, split))[:2] for split in ("train", "test")]
    except FileNotFoundError as error:
        raise SystemExit(str(error)) from None
    return [data.ImageDataset(paths, labels, args.image_size, train=split == 0) for split, (paths, labels) in enumerate(splits)]


def describe_sets(train, test):
    """One line: the images and classes of the training and test sets."""
    def size(dataset):
        return f"{len(dataset):,} images of {torch.unique(torch.as_tensor(dataset.labels)).numel():,} classes"

    return f"train set: {size(train)}; test set: {size(test)}"


def check_ks(ks, test_size):
    """Refuses a k that the test set cannot rank: evaluation is leave-one-out, each of the test_size
    images a query whose gallery is the other test_size - 1, so every k must be at most test_size - 1."""
    gallery = test_size - 1
    if gallery < 1:
        raise SystemExit(f"the test set has {test_size} image(s): leave-one-out evaluation needs at least 2")
    if max(ks) > gallery:
        fitting = " ".join(str(k) for k in ks if k <= gallery) or str(gallery)
        raise SystemExit(f"--ks {max(ks)} is larger than the test set allows: it has {test_size:,} images, and "
                         f"leave-one-out evaluation ranks each against the other {gallery:,}, so every k must be at "
                         f"most {gallery:,} (e.g. --ks {fitting})")


def batches(dataset, sampler, workers, seed=0):
    """(inputs, labels, ids) per batch of the sampler; ids are the dataset indices (stable across steps).
    `seed` seeds the augmentations (give every process and every resumed start its own)."""
    if isinstance(dataset, TensorData):
        for indices in sampler:
            indices = torch.tensor(indices)
            yield (*dataset.batch(indices), indices)
        return
    yield from torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                                           persistent_workers=workers > 0, pin_memory=torch.cuda.is_available(),
                                           generator=torch.Generator().manual_seed(seed))


def build_model(args, train):
    if args.backbone == "convnet":
        return models.SmallConvNet(args.dim, 3 if isinstance(train, data.ImageDataset) else 1, args.width)
    if args.backbone in ("linear", "mlp"):
        if not isinstance(train, TensorData) or train.inputs.dim() != 2:
            raise SystemExit(f"--backbone {args.backbone} is a head over features: use it with --data features")
        return models.FeatureHead(train.inputs.shape[1], args.dim, args.hidden if args.backbone == "mlp" else 0)
    return models.torchvision_backbone(args.backbone, args.dim, args.weights)


def build_schedule(args, optimizer):
    milestones = [round(f * args.steps) for f in args.milestones]

    def factor(step):
        warm = min(1.0, (step + 1) / args.warmup_steps) if args.warmup_steps else 1.0
        if args.schedule == "step":
            return warm * args.gamma ** sum(step >= m for m in milestones)
        if args.schedule == "cosine":
            return warm * 0.5 * (1 + math.cos(math.pi * min(step, args.steps) / args.steps))
        return warm

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---- evaluation and records ------------------------------------------------------------------------
@torch.no_grad()
def embed(model, dataset, args, device):
    model.eval()
    order = list(range(len(dataset)))
    parts, labels = [], []
    for inputs, targets, _ in batches(dataset, [order[i:i + args.eval_batch] for i in range(0, len(order), args.eval_batch)],
                                      args.workers):
        with autocast(args, device):
            parts.append(model(inputs.to(device)).float().cpu())
        labels.append(targets)
    model.train()
    if args.freeze_bn:
        models.freeze_batchnorm(model)
    return torch.cat(parts), torch.cat(labels)


def evaluate(model, test, args, device):
    embeddings, labels = embed(model, test, args, device)
    return evaluation.evaluate(embeddings, labels, args.ks)  # (check_ks has ruled out a k beyond the test set)


def autocast(args, device):
    if args.amp == "off":  # (init_processes refuses --amp on any device but CUDA)
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.bfloat16 if args.amp == "bf16" else torch.float16)


def write_metrics(history, out):
    with open(os.path.join(out, "metrics.json"), "w") as handle:  # (an undefined metric, NaN, as null: valid JSON)
        json.dump([{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
                   for row in history], handle, indent=1, allow_nan=False)
    columns = list(dict.fromkeys(k for row in history for k in row))
    with open(os.path.join(out, "metrics.csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows(history)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    # (precision_at_1 is Recall@1, and is there whatever --ks holds)
    ax.plot([r["step"] for r in history], [100 * r["precision_at_1"] for r in history], marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("Recall@1 on the held-out classes (%)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "recall.png"), dpi=120)
    plt.close(fig)


# ---- training --------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_processes(args)
    torch.manual_seed(args.seed)
    train, test = load_data(args)
    if rank == 0:
        print(describe_sets(train, test), flush=True)
    check_ks(args.ks, len(test))
    os.makedirs(args.out, exist_ok=True)
    model = build_model(args, train).to(device)
    if args.freeze_bn:
        models.freeze_batchnorm(model)
    wrapped = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[args.optimizer](
        parameters, lr=args.lr, weight_decay=args.weight_decay, **({"momentum": 0.9} if args.optimizer == "sgd" else {}))
    schedule = build_schedule(args, optimizer)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp == "fp16" and device.type == "cuda")
    loss_options = dict(alpha=args.alpha, beta=args.beta, base=args.base, epsilon=args.epsilon, mining=args.mining,
                        skip_incomplete_anchors=args.skip_incomplete_anchors, backend=args.backend)
    memory = (ms_loss_cuda.CrossBatchMemory(args.memory_size, args.dim, weight=args.memory_weight,
                                            warmup=args.memory_warmup, **loss_options).to(device)
              if args.memory_size else None)

    checkpoint_path = os.path.join(args.out, "checkpoint.pt")
    step, history = 0, []
    resume = [args.resume and os.path.exists(checkpoint_path)]
    if world > 1:  # rank 0 decides: every rank must take the same path through the collectives
        dist.broadcast_object_list(resume, src=0)
    if resume[0]:
        state = checkpoint.load(checkpoint_path, device)
        changed = checkpoint.changed_settings(state.get("args"), vars(args))
        if changed:
            raise SystemExit(f"--resume: {checkpoint_path} was made with {', '.join(changed)}; resume with its "
                             f"settings (only the steps, the evaluation and the output may change), or start a new --out")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        if state["scaler"]:  # (empty when the run has no --amp fp16)
            scaler.load_state_dict(state["scaler"])
        if memory is not None:
            memory.load_state_dict(state["memory"])
        step, history = state["step"], state["history"]
        if state.get("rng") is not None:  # (every rank takes rank 0's state, as every rank starts from one seed)
            checkpoint.restore_rng(state["rng"], device)
        if rank == 0:
            print(f"resumed from {checkpoint_path} at step {step}")

    def loss_of(embeddings, labels, ids):
        if world > 1:
            return distributed.multi_similarity_loss(embeddings, labels, ids, memory=memory,
                                                     **({} if memory is not None else loss_options))
        if memory is not None:
            return memory(embeddings, labels, ids)
        return ms_loss_cuda.multi_similarity_loss(embeddings, labels, ids=ids, **loss_options)

    progress = None  # the tqdm bar, rank 0

    def save_checkpoint():  # plain data only (train/checkpoint.py): loading it never runs code
        state = dict(model=model.state_dict(), optimizer=optimizer.state_dict(), schedule=schedule.state_dict(),
                     scaler=scaler.state_dict(), memory=None if memory is None else memory.state_dict(), step=step,
                     history=history, args=vars(args), rng=checkpoint.rng_state(device))
        checkpoint.save(state, checkpoint_path)

    def record(loss_sum, mined_sum, steps_since, seconds):
        metrics = evaluate(model, test, args, device) if rank == 0 else {}
        if rank == 0:
            row = {"step": step, "images_seen": step * args.batch_size,
                   "train_loss": loss_sum / steps_since if steps_since else None,
                   "mined": mined_sum / steps_since if steps_since else None,
                   "train_seconds": round(seconds, 1), **metrics}
            history.append(row)
            write_metrics(history, args.out)
            shown = ", ".join(f"{k} {100 * v:.2f}" for k, v in metrics.items() if k.startswith("recall@"))
            (print if progress is None else progress.write)(f"step {step}: {shown}")
            save_checkpoint()
        if world > 1:
            dist.barrier()

    try:  # (before the first evaluation, which may take long)
        sampler = data.ClassBalancedBatches(train.labels, args.batch_size, args.per_class, args.steps, rank=rank,
                                            world_size=world, seed=args.seed, start=step)
    except ValueError as error:  # (too few classes for the batch, or a batch the processes cannot share)
        raise SystemExit(str(error)) from None
    if not history:
        record(0.0, 0.0, 0, 0.0)
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=step, unit="step", dynamic_ncols=True)
    loss_sum = mined_sum = 0.0
    steps_since, started, seconds = 0, time.perf_counter(), history[-1]["train_seconds"] if history else 0.0
    for inputs, labels, ids in batches(train, sampler, args.workers, seed=(args.seed * 1000 + rank) * 1000003 + step):
        tick = time.perf_counter()
        inputs, labels, ids = inputs.to(device, non_blocking=True), labels.to(device), ids.to(device)
        optimizer.zero_grad(set_to_none=True)

        def encode(chunk):
            with autocast(args, device):
                return wrapped(chunk)

        def scaled_loss(embeddings):  # under autocast: a float32 loss for the scaler, as torch's losses
            with autocast(args, device):
                return scaler.scale(loss_of(embeddings, labels, ids))

        if args.chunk_size:
            loss, embeddings = gradient_cache.cached_step(encode, inputs, scaled_loss, args.chunk_size, model=wrapped,
                                                          no_sync=wrapped.no_sync if world > 1 else None)
        else:
            embeddings = encode(inputs)
            loss = scaled_loss(embeddings)
            loss.backward()
        loss_scale = scaler.get_scale() if scaler.is_enabled() else 1.0  # (update() may change it)
        scaler.step(optimizer)
        scaler.update()
        schedule.step()
        step += 1
        loss_sum += loss.item() / loss_scale
        mined_sum += reference.mined_fraction(embeddings.detach(), labels, ids=ids, epsilon=args.epsilon)
        steps_since += 1
        seconds += time.perf_counter() - tick
        if progress is not None:
            progress.update()
            progress.set_postfix(loss=f"{loss_sum / steps_since:.4f}", mined=f"{100 * mined_sum / steps_since:.1f}%",
                                 img_s=f"{args.batch_size * steps_since / (time.perf_counter() - started):.0f}")
        last = step == args.steps
        if last or (args.eval_every and step % args.eval_every == 0):
            record(loss_sum, mined_sum, steps_since, seconds)
            loss_sum = mined_sum = 0.0
            steps_since, started = 0, time.perf_counter()
        elif args.checkpoint_every and step % args.checkpoint_every == 0 and rank == 0:
            save_checkpoint()
    if progress is not None:
        progress.close()
    if rank == 0 and len(history) > 1:
        first, final = history[0], history[-1]
        print("Recall@K on the held-out classes, before -> after training:")
        for key in (k for k in final if k.startswith("recall@")):
            print(f"  {key:>12}: {100 * first[key]:6.2f} -> {100 * final[key]:6.2f}")
    if world > 1:
        del wrapped  # (DistributedDataParallel goes before its process group)
        dist.destroy_process_group()
    return history


if __name__ == "__main__":
    main()
