"""The training command's options (python -m ms_loss_cuda.train --help): the argument parser, whose
every help line ends with its default, and the checks that turn a value the run cannot use (a
count, a rate, a hyper-parameter, a batch that is not whole classes) into a usage error before any
data is read."""
import argparse
import math
import os
import sys

from ms_loss_cuda.common import check_hyper_parameters
from ms_loss_cuda.loss import BACKENDS
from ms_loss_cuda.train.checkpoint import same_setting
from ms_loss_cuda.train.models import BUILT_IN

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


def build_parser(description=None):
    """The command's argument parser: every option has a help line that ends with its default."""
    p = argparse.ArgumentParser(prog="python -m ms_loss_cuda.train", description=description,
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
    _option(g, "--freeze-bn", action="store_true",
            help="batch-norm statistics and affine parameters fixed, as the MS authors train")
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
    _option(g, "--backend", default="auto", choices=BACKENDS,
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
    _option(g, "--resume", action="store_true",
            help="continue from OUT/checkpoint.pt when it exists, with its settings and data (--root may name "
                 "another folder of the same data; a larger --steps extends the run: the schedule of the new length "
                 "from the step it resumes at)")
    _option(g, "--no-progress", action="store_true", help="no progress bar")
    return p


def _check_numbers(parser, args):
    """parser.error for a count or a rate the run cannot use, and for the loss's hyper-parameters that
    the loss would refuse at its first call."""
    least = dict(seed=0, steps=1, dim=1, width=1, hidden=1, eval_batch=1, image_size=1, workers=0, chunk_size=0,
                 warmup_steps=0, eval_every=0, checkpoint_every=0, memory_size=0, memory_warmup=0,
                 kanji_classes=2, kanji_train_instances=2, kanji_test_instances=2)
    for name, value in least.items():
        if getattr(args, name) is not None and getattr(args, name) < value:
            parser.error(f"--{name.replace('_', '-')} must be at least {value}, got {getattr(args, name)}")
    rates = dict(lr=(args.lr, False), weight_decay=(args.weight_decay, True), gamma=(args.gamma, False),
                 memory_weight=(args.memory_weight, True), kanji_jitter=(args.kanji_jitter, True))
    for name, (value, zero) in rates.items():
        if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
            parser.error(f"--{name.replace('_', '-')} must be a finite number {'>= 0' if zero else '> 0'}, got {value}")
    if not all(0 <= f <= 1 for f in args.milestones):  # (NaN fails both comparisons)
        parser.error(f"--milestones are fractions of --steps, each from 0 to 1, got {' '.join(map(str, args.milestones))}")
    try:
        check_hyper_parameters(args.alpha, args.beta, args.base, args.epsilon, "mean")
    except ValueError as error:
        parser.error(f"--{error}")


def parse_args(argv=None, description=None):
    """The command's arguments, checked; `description` heads --help."""
    parser = build_parser(description)
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
    if args.backbone == "convnet" and args.image_size < 16:
        parser.error(f"--image-size {args.image_size}: the convnet halves its input four times, so it needs at least 16")
    if args.weights is not None and args.backbone in BUILT_IN:
        parser.error(f"--weights loads a torchvision backbone's state_dict; --backbone {args.backbone} is built in "
                     "and has none")
    if args.weights is not None and not os.path.isfile(args.weights):
        parser.error(f"--weights {args.weights} does not exist")
    if 0 < args.memory_size < args.batch_size:
        parser.error(f"--memory-size ({args.memory_size}) must be at least --batch-size ({args.batch_size}): each "
                     f"step stores the whole batch, so a smaller memory would never hold an earlier one")
    if os.environ.get("RANK", "0") == "0":
        for note in _unread_options(parser, args):
            print(note, file=sys.stderr)
    return args


def _unread_options(parser, args):
    """A note for each option given a value that this run never reads: one of another data set,
    backbone or schedule, of the memory without one, or the mining margin with mining off."""
    readers = dict(
        **dict.fromkeys(("train_features", "train_labels", "test_features", "test_labels"),
                        (args.data == "features", "--data features")),
        **dict.fromkeys(("kanji_classes", "kanji_train_instances", "kanji_test_instances", "kanji_jitter"),
                        (args.data == "kanji", "--data kanji")),
        root=(args.data != "features", "--data kanji, sop or folders"),
        workers=(args.data in ("sop", "folders"), "--data sop or folders"),
        width=(args.backbone == "convnet", "--backbone convnet"), hidden=(args.backbone == "mlp", "--backbone mlp"),
        **dict.fromkeys(("milestones", "gamma"), (args.schedule == "step", "--schedule step")),
        epsilon=(args.mining, "mining (it is off: --no-mining)"),
        **dict.fromkeys(("memory_weight", "memory_warmup"), (args.memory_size > 0, "--memory-size")))
    return [f"note: --{name.replace('_', '-')} has no effect without {needs}" for name, (read, needs) in readers.items()
            if not read and not same_setting(getattr(args, name), parser.get_default(name))]

