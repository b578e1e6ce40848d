"""Train an embedding with the fused MS loss: python -m ms_loss_cuda.train --help (or ms-loss-train).

One process, or several with torchrun (`torchrun --nproc-per-node 8 -m ms_loss_cuda.train ...`):
each process takes its share of every global P x M batch, the loss is the MS loss of the global
batch (ms_loss_cuda.distributed) and DistributedDataParallel averages the gradients. --chunk-size
turns on embedding-gradient caching, so the batch is limited by the [B, D] embeddings, not by the
activations. Rank 0 prints the sizes of the train and test sets, shows a progress bar, evaluates on
the held-out classes every --eval-every steps and writes OUT/metrics.json, OUT/metrics.csv,
OUT/recall.png and OUT/checkpoint.pt (plain data: --resume loads it with weights_only=True).
"""
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
from ms_loss_cuda.train import checkpoint, data, kanji, models, options  # noqa: E402


# ---- setup ----------------------------------------------------------------------------------------
def init_processes(args):
    """(rank, world size, device); torchrun's environment starts the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as error:
        raise SystemExit(f"--device {args.device}: {error}") from None
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {args.device}: the command trains on cpu or cuda (cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA GPU")
    runs_here = ms_loss_cuda.available_backends(device)
    if args.backend != "auto" and args.backend not in runs_here:  # (found now, not after the first evaluation)
        raise SystemExit(f"--backend {args.backend} does not run on {device.type} in this install; the backends "
                         f"that do: {', '.join(runs_here)}")
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
        try:
            sets = kanji.load(cache, train_per_class=args.kanji_train_instances,
                              test_per_class=args.kanji_test_instances, size=args.image_size, jitter=args.kanji_jitter,
                              classes=args.kanji_classes)
        except ValueError as error:  # (more characters than KanjiVG has)
            raise SystemExit(f"--kanji-{error}") from None
        return [TensorData(torch.from_numpy(x), torch.from_numpy(y)) for x, y in (sets["train"], sets["test"])]
    if args.data == "features":
        if not (args.train_features and args.test_features):
            raise SystemExit("--data features needs --train-features and --test-features")
        try:
            sets = [TensorData(*data.read_features(f, l)) for f, l in ((args.train_features, args.train_labels),
                                                                       (args.test_features, args.test_labels))]
        except (ValueError, FileNotFoundError) as error:  # (a missing file, or one that holds no features or labels)
            raise SystemExit(str(error)) from None
        if sets[0].inputs.shape[1] != sets[1].inputs.shape[1]:
            raise SystemExit(f"--test-features {args.test_features} holds features of {sets[1].inputs.shape[1]} "
                             f"dimensions; the training features have {sets[0].inputs.shape[1]}")
        return sets
    if not args.root:
        raise SystemExit(f"--data {args.data} needs --root")
    try:
        if args.data == "sop":
            splits = [data.read_sop(args.root, split) for split in ("train", "test")]
        else:
            splits = [data.read_folders(os.path.join(args.root, split))[:2] for split in ("train", "test")]
    except (FileNotFoundError, ValueError) as error:  # (a missing file, or a malformed listing)
        raise SystemExit(str(error)) from None
    return [data.ImageDataset(paths, labels, args.image_size, train=split == 0) for split, (paths, labels) in enumerate(splits)]


def describe_sets(train, test):
    """The lines to print of the training and test sets: their images and classes, and the images
    alone in their class (they have no positive pair to train on, or no right answer to retrieve).
    SystemExit where a set has no class of two images, or one class alone: nothing to train on, or
    nothing to measure."""
    lines, alone = [], []
    for name, dataset in (("train", train), ("test", test)):
        counts = torch.unique(torch.as_tensor(dataset.labels), return_counts=True)[1]
        lines.append(f"{name} set: {len(dataset):,} images of {counts.numel():,} classes")
        alone.append(int((counts == 1).sum()))
        if alone[-1] == counts.numel():
            raise SystemExit(f"the {name} set has no class of two or more images: "
                             + ("the loss has no positive pair to train on" if name == "train" else
                                "leave-one-out retrieval has no right answer for any query"))
        if counts.numel() == 1:
            raise SystemExit(f"the {name} set has one class: " + (
                "the loss has no negative pair to train on" if name == "train" else
                "every neighbour is of the query's class, so Recall@K is 1 whatever the model"))
    lines = ["; ".join(lines)]
    if alone[0]:
        lines.append(f"note: {alone[0]:,} training class(es) of one image: they have no positive pair, and serve "
                     "only as negatives")
    if alone[1]:
        lines.append(f"note: {alone[1]:,} test image(s) alone in their class count as misses in Recall@K (no other "
                     "image of their class to find); MAP@R leaves them out")
    return lines


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


def batches(dataset, sampler, workers):
    """(inputs, labels, ids) per batch of the sampler; ids are the dataset indices (stable across steps).
    An image set's augmentations are seeded by the sampler's keys (ClassBalancedBatches' keyed)."""
    if isinstance(dataset, TensorData):
        for indices in sampler:
            indices = torch.tensor(indices)
            yield (*dataset.batch(indices), indices)
        return
    yield from torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                                           persistent_workers=workers > 0, pin_memory=torch.cuda.is_available(),
                                           generator=torch.Generator())  # (its own: torch's global one stays untouched)


def build_model(args, train):
    images = isinstance(train, data.ImageDataset) or (isinstance(train, TensorData) and train.inputs.dim() == 3)
    if args.backbone == "convnet":
        if not images:
            raise SystemExit("--backbone convnet takes images: use --backbone linear or mlp with --data features")
        return models.SmallConvNet(args.dim, 3 if isinstance(train, data.ImageDataset) else 1, args.width)
    if args.backbone in ("linear", "mlp"):
        if images:
            raise SystemExit(f"--backbone {args.backbone} is a head over features: use it with --data features")
        return models.FeatureHead(train.inputs.shape[1], args.dim, args.hidden if args.backbone == "mlp" else 0)
    if not isinstance(train, data.ImageDataset):
        raise SystemExit(f"--backbone {args.backbone} is not built in ({', '.join(models.BUILT_IN)}), so it names a "
                         f"torchvision model, which takes RGB images: use it with --data sop or folders, or use "
                         f"--backbone {'linear' if args.data == 'features' else 'convnet'}")
    try:
        return models.torchvision_backbone(args.backbone, args.dim, args.weights)
    except (RuntimeError, ValueError) as error:  # (no torchvision, an unknown name, or weights that do not fit)
        raise SystemExit(str(error)) from None


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


def evaluate(model, test, args, device, step):
    embeddings, labels = embed(model, test, args, device)
    if not torch.isfinite(embeddings).all():
        raise SystemExit(f"step {step}: the test set's embeddings hold NaN or infinite values: the model diverged "
                         f"(a lower --lr, or --amp bf16 in place of fp16, may help)")
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
    args = options.parse_args(argv, __doc__)
    rank, world, device = init_processes(args)
    torch.manual_seed(args.seed)
    train, test = load_data(args)
    described = describe_sets(train, test)
    digest = checkpoint.data_digest((train, test), args.root)
    if rank == 0:
        print("\n".join(described), flush=True)
    check_ks(args.ks, len(test))
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise SystemExit(f"--out {args.out} is a file: the command writes a folder there")
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
    # the steps since the last evaluation (their loss, mined share and count) and the training time so far
    step, history, running = 0, [], dict(loss=0.0, mined=0.0, steps=0, seconds=0.0)
    resume = [args.resume and os.path.exists(checkpoint_path)]
    if rank == 0 and not args.resume and os.path.exists(checkpoint_path):
        print(f"note: {checkpoint_path} holds an earlier run, which this one replaces (--resume continues it)")
    if world > 1:  # rank 0 decides: every rank must take the same path through the collectives
        dist.broadcast_object_list(resume, src=0)
    if resume[0]:
        try:
            state = checkpoint.load(checkpoint_path, device)
        except ValueError as error:  # (not plain data, or not a torch.save file at all)
            raise SystemExit(f"--resume: {error}") from None
        if not isinstance(state, dict):
            raise SystemExit(f"--resume: {checkpoint_path} is not a checkpoint of this run (it holds a "
                             f"{type(state).__name__})")
        changed = checkpoint.changed_settings(state.get("args"), vars(args))
        if changed:
            raise SystemExit(f"--resume: {checkpoint_path} was made with {', '.join(changed)}; resume with its "
                             f"settings (only the steps, the evaluation and the output may change), or start a new --out")
        if state.get("data", digest) != digest:
            where = f" under --root {args.root}" if args.root else ""
            raise SystemExit(f"--resume: {checkpoint_path} was made on other data than this run's{where} (other "
                             f"labels, image paths or sample shapes); resume on its data, or start a new --out")
        try:  # (a file of another run, which recorded no settings: another model, optimiser or memory)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            schedule.load_state_dict(state["schedule"])
            if state["scaler"]:  # (empty when the run has no --amp fp16)
                scaler.load_state_dict(state["scaler"])
            if memory is not None:
                memory.load_state_dict(state["memory"])
            step, history = int(state["step"]), list(state["history"])
            running.update(state.get("running") or dict(seconds=history[-1]["train_seconds"]))
            if state.get("rng") is not None:  # (every rank takes rank 0's state, as every rank starts from one seed)
                checkpoint.restore_rng(state["rng"], device)
        except (KeyError, TypeError, AttributeError, ValueError, RuntimeError) as error:
            raise SystemExit(f"--resume: {checkpoint_path} is not a checkpoint of this run ({type(error).__name__}: "
                             f"{error})") from None
        for group, factor in zip(optimizer.param_groups, schedule.lr_lambdas):  # (a new --steps: its schedule)
            group["lr"] = group["initial_lr"] * factor(step)
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
                     history=history, running=dict(running), args=vars(args), rng=checkpoint.rng_state(device),
                     data=digest)
        checkpoint.save(state, checkpoint_path)

    def record():  # evaluates, writes the metrics and the checkpoint, and starts the next interval
        metrics = evaluate(model, test, args, device, step) if rank == 0 else {}
        done, loss, mined = running["steps"], running["loss"], running["mined"]
        running.update(loss=0.0, mined=0.0, steps=0)
        if rank == 0:
            row = {"step": step, "images_seen": step * args.batch_size,
                   "train_loss": loss / done if done else None,
                   "mined": mined / done if done else None,
                   "train_seconds": round(running["seconds"], 1), **metrics}
            history.append(row)
            write_metrics(history, args.out)
            shown = ", ".join(f"{k} {100 * v:.2f}" for k, v in metrics.items() if k.startswith("recall@"))
            (print if progress is None else progress.write)(f"step {step}: {shown}")
            save_checkpoint()
        if world > 1:
            dist.barrier()

    try:  # (before the first evaluation, which may take long)
        sampler = data.ClassBalancedBatches(train.labels, args.batch_size, args.per_class, args.steps, rank=rank,
                                            world_size=world, seed=args.seed, start=step,
                                            keyed=isinstance(train, data.ImageDataset))
    except ValueError as error:  # (too few classes for the batch, or a batch the processes cannot share)
        raise SystemExit(str(error)) from None
    if not history:
        record()
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=step, unit="step", dynamic_ncols=True)
    started, timed = time.perf_counter(), 0  # (the progress bar's images a second: the steps since `started`)
    for inputs, labels, ids in batches(train, sampler, args.workers):
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
        running["loss"] += loss.item() / loss_scale
        running["mined"] += (reference.mined_fraction(embeddings.detach(), labels, ids=ids, epsilon=args.epsilon)
                             if args.mining else 1.0)  # (mining off: every pair is used)
        running["steps"] += 1
        running["seconds"] += time.perf_counter() - tick
        timed += 1
        if progress is not None:
            progress.update()
            progress.set_postfix(loss=f"{running['loss'] / running['steps']:.4f}",
                                 mined=f"{100 * running['mined'] / running['steps']:.1f}%",
                                 img_s=f"{args.batch_size * timed / (time.perf_counter() - started):.0f}")
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            record()
            started, timed = time.perf_counter(), 0
        elif args.checkpoint_every and step % args.checkpoint_every == 0 and rank == 0:
            save_checkpoint()
    if progress is not None:
        progress.close()
    if rank == 0 and len(history) > 1:
        first, final = history[0], history[-1]
        print("Recall@K on the held-out classes, before -> after training:")
        for key in (k for k in final if k.startswith("recall@") and k in first):  # (--ks may change on resume)
            print(f"  {key:>12}: {100 * first[key]:6.2f} -> {100 * final[key]:6.2f}")
    if world > 1:
        del wrapped  # (DistributedDataParallel goes before its process group)
        dist.destroy_process_group()
    return history


def cli():
    """The ms-loss-train console script: main, whose history would be the exit status otherwise."""
    main()


if __name__ == "__main__":
    main()
