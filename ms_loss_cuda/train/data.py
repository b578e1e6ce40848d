"""Training data: readers for SOP, a folder per class and precomputed features; the authors' image
transforms; and the class-balanced P x M batch sampler (one share of every global batch per process).

Every reader returns (items, labels): items are image paths (or feature rows), labels int64 class
indices. A malformed file raises ValueError naming the file and the line; a missing one (a listing,
or an image it lists), FileNotFoundError naming the path. Nothing is silently dropped. An image that
exists but does not decode raises ValueError naming it when it is first drawn.
"""
import math
import os

import numpy as np
import torch

from ms_loss_cuda.train import checkpoint

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
# The MS authors' crop: scale [0.16, 1] of the image area, aspect ratio 3/4..4/3; ImageNet statistics.
CROP_SCALE, CROP_RATIO = (0.16, 1.0), (3 / 4, 4 / 3)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _require(path):
    if not os.path.exists(path):
        raise FileNotFoundError(f"expected {path}, which does not exist")
    return path


# ---- readers ------------------------------------------------------------------------------------
def read_sop(root, split="train"):
    """Stanford Online Products: `root` holds Ebay_train.txt / Ebay_test.txt (a header line, then
    `image_id class_id super_class_id path` per line; class ids from 1). Returns (paths, labels)
    with labels = class_id - 1, so train and test keep SOP's disjoint class ids."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    listing = _require(os.path.join(root, f"Ebay_{split}.txt"))
    paths, labels = [], []
    with open(listing, encoding="utf-8") as handle:
        header = handle.readline().split()
        if header[:4] != ["image_id", "class_id", "super_class_id", "path"]:
            raise ValueError(f"{listing}:1: expected the header 'image_id class_id super_class_id path', got {header}")
        for number, line in enumerate(handle, start=2):
            fields = line.split()
            if not fields:
                continue
            if (len(fields) != 4 or not all(f.isascii() and f.isdigit() for f in fields[:3])
                    or not 1 <= int(fields[1]) <= 2 ** 63):
                raise ValueError(f"{listing}:{number}: expected 'image_id class_id super_class_id path' with "
                                 f"integer ids (class_id from 1 to 2^63), got {line.strip()!r}")
            paths.append(os.path.join(root, fields[3]))
            labels.append(int(fields[1]) - 1)
    if not paths:
        raise ValueError(f"{listing}: no images listed")
    missing = [path for path in paths if not os.path.isfile(path)]  # (one stat each: found now, not mid-run)
    if missing:
        raise FileNotFoundError(f"{listing}: {len(missing):,} of the {len(paths):,} images it lists do not exist "
                                f"(the first: {missing[0]})")
    return paths, torch.tensor(labels)


def read_folders(root):
    """A folder per class (`root/<class>/<image>`), classes in sorted order; hidden folders and files
    (names from "."; a notebook's checkpoints, macOS's "._" copies) are not read. Returns (paths,
    labels, class names)."""
    classes = sorted(d for d in os.listdir(_require(root)) if os.path.isdir(os.path.join(root, d))
                     and not d.startswith("."))
    if not classes:
        raise ValueError(f"{root}: no class folders inside")
    paths, labels = [], []
    for label, name in enumerate(classes):
        files = sorted(f for f in os.listdir(os.path.join(root, name))
                       if f.lower().endswith(IMAGE_EXTENSIONS) and not f.startswith("."))
        if not files:
            raise ValueError(f"{os.path.join(root, name)}: no images ({', '.join(IMAGE_EXTENSIONS)})")
        paths += [os.path.join(root, name, f) for f in files]
        labels += [label] * len(files)
    return paths, torch.tensor(labels), classes


def _load_array(path):
    """The contents of a .npy file (a tensor) or of a .pt file (tensors only: weights_only); a ValueError
    that names the file where it holds anything else."""
    if not path.endswith((".npy", ".pt")):
        raise ValueError(f"{path}: features and labels are read from .npy or .pt files")
    if path.endswith(".pt"):
        return checkpoint.load(path)  # (a ValueError naming the file for anything but plain data)
    try:
        return torch.from_numpy(np.load(path))
    except (ValueError, TypeError, RuntimeError) as error:
        raise ValueError(f"{path}: not an array that can be read without unpickling objects ({error})") from None


def read_features(features, labels=None):
    """Precomputed features (to train a head on a frozen backbone): `features` a .npy/.pt file of
    [N, D], and `labels` a .npy/.pt file of [N] integers; or a single .pt holding the dict
    {"features": [N, D], "labels": [N]}. Returns (features float32, labels int64)."""
    data = _load_array(_require(features))
    if isinstance(data, dict):
        if labels is not None or not {"features", "labels"} <= set(data):
            raise ValueError(f"{features}: a .pt dict must hold 'features' and 'labels' (and no labels file is "
                             f"given beside it); it holds {sorted(data)}")
        data, targets = data["features"], data["labels"]
    elif labels is None:
        raise ValueError(f"{features}: holds a bare array; pass its labels file too")
    else:
        targets = _load_array(_require(labels))
    data, targets = torch.as_tensor(data), torch.as_tensor(targets)
    if data.dim() != 2 or not data.is_floating_point() or data.shape[1] == 0:
        raise ValueError(f"{features}: features must be a float [N, D] array (D >= 1), got {data.dtype} "
                         f"{tuple(data.shape)}")
    if targets.shape != (data.shape[0],) or targets.is_floating_point() or targets.is_complex():
        raise ValueError(f"{labels or features}: labels must be {data.shape[0]} integers, got {targets.dtype} "
                         f"{tuple(targets.shape)}")
    if not torch.isfinite(data).all():
        rows = (~torch.isfinite(data)).any(dim=1).nonzero().flatten()
        raise ValueError(f"{features}: features must be finite; {rows.numel()} row(s) hold NaN or an infinity "
                         f"(the first: row {rows[0].item()})")
    return data.float(), targets.long()


# ---- images and transforms ------------------------------------------------------------------------
def random_resized_crop(image, size, rng, scale=CROP_SCALE, ratio=CROP_RATIO):
    """A random crop of `scale` of the area and `ratio` aspect, resized to size x size (PIL image);
    the centre crop after 10 failed draws, as torchvision does."""
    from PIL import Image

    width, height = image.size
    for _ in range(10):
        area = width * height * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        w, h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = rng.integers(0, width - w + 1), rng.integers(0, height - h + 1)
            return image.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h))
    return centre_crop(image, size, size)


def centre_crop(image, resize, size):
    """Shorter side to `resize`, then the central size x size."""
    from PIL import Image

    width, height = image.size
    factor = resize / min(width, height)
    image = image.resize((max(size, round(width * factor)), max(size, round(height * factor))), Image.BILINEAR)
    left, top = (image.size[0] - size) // 2, (image.size[1] - size) // 2
    return image.crop((left, top, left + size, top + size))


def to_tensor(image, mean=MEAN, std=STD):
    """float32 [C, H, W], normalised per channel."""
    array = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)
    array = array[:, :, None] if array.dim() == 2 else array
    channels = array.shape[2]
    return (array.permute(2, 0, 1) - torch.tensor(mean[:channels])[:, None, None]) / torch.tensor(std[:channels])[:, None, None]


class ImageDataset(torch.utils.data.Dataset):
    """(image, label, index) from paths, RGB. train=True: random resized crop of `size` and a horizontal flip (the
    authors' training transform); else resize to size * 8 / 7 and a centre crop (their test one). An item is an
    index, or (index, key) where `key` (a tuple of ints >= 0) seeds that sample's crop and flip: ClassBalancedBatches'
    keys make them the same whatever the workers and processes, and in a resumed run; without one, torch's
    per-worker generator draws them."""

    def __init__(self, paths, labels, size=224, train=False):
        self.paths, self.labels, self.size, self.train = paths, labels, size, train

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, item):
        from PIL import Image

        index, key = item if isinstance(item, tuple) else (item, None)

        try:
            with Image.open(self.paths[index]) as handle:
                image = handle.convert("RGB")
        except (OSError, ValueError) as error:
            raise ValueError(f"{self.paths[index]}: cannot read the image ({error})") from error
        if self.train:
            rng = np.random.default_rng(key if key is not None else int(torch.randint(2 ** 62, ())))
            image = random_resized_crop(image, self.size, rng)
            if rng.random() < 0.5:
                image = image.transpose(Image.FLIP_LEFT_RIGHT)
        else:
            image = centre_crop(image, round(self.size * 8 / 7), self.size)
        return to_tensor(image), self.labels[index], index


# ---- the P x M sampler ----------------------------------------------------------------------------
class ClassBalancedBatches(torch.utils.data.Sampler):
    """Batches of P = batch_size / per_class classes with `per_class` (M) samples each, the MS authors'
    RandomIdentitySampler: classes drawn without replacement, samples without replacement inside a
    class, topped up with replacement when a class has fewer than M.

    Under several processes every process draws the same global batch (seeded by the seed and the
    step) and yields its own share, rank `rank` of `world_size` contiguous parts (class groups stay
    whole when the batch divides evenly). `start` skips that many batches, so a resumed run continues
    the same sequence. Yields `steps` batches of indices; with `keyed`, of (index, (seed, step, position
    in the global batch)), the keys ImageDataset seeds each sample's augmentation with.
    """

    def __init__(self, labels, batch_size, per_class, steps, *, rank=0, world_size=1, seed=0, start=0, keyed=False):
        labels = torch.as_tensor(labels).cpu().numpy()
        if per_class < 1 or batch_size < 1 or batch_size % per_class:
            raise ValueError(f"the batch size ({batch_size}) must be a positive multiple of the samples per class "
                             f"({per_class})")
        self.classes, inverse = np.unique(labels, return_inverse=True)
        if batch_size // per_class > len(self.classes):
            raise ValueError(f"a batch of {batch_size} with {per_class} per class needs {batch_size // per_class} "
                             f"classes; the data has {len(self.classes)}")
        if not 0 <= rank < world_size or world_size > batch_size:
            raise ValueError(f"rank {rank} of {world_size} processes cannot share a batch of {batch_size}")
        self.members = np.argsort(inverse, kind="stable")
        counts = np.bincount(inverse)
        self.starts, self.counts = np.cumsum(counts) - counts, counts
        self.batch_size, self.per_class, self.steps, self.start = batch_size, per_class, steps, start
        self.rank, self.world_size, self.seed, self.keyed = rank, world_size, seed, keyed

    def __len__(self):
        return max(self.steps - self.start, 0)

    def global_batch(self, step):
        """The indices of the whole batch of `step` (every process's share)."""
        rng = np.random.default_rng([self.seed, step])
        chosen = rng.choice(len(self.classes), self.batch_size // self.per_class, replace=False)
        counts = self.counts[chosen]
        # M distinct members of each class; all M drawn with replacement for a class smaller than M.
        picks = np.empty((len(chosen), self.per_class), dtype=np.int64)
        small = counts < self.per_class
        for row in np.flatnonzero(~small):
            picks[row] = rng.choice(counts[row], self.per_class, replace=False)
        picks[small] = (rng.random((int(small.sum()), self.per_class)) * counts[small, None]).astype(np.int64)
        return self.members[self.starts[chosen, None] + picks].reshape(-1)

    def __iter__(self):
        for step in range(self.start, self.steps):
            shares = np.array_split(self.global_batch(step), self.world_size)
            share = shares[self.rank].tolist()
            if self.keyed:
                first = sum(len(s) for s in shares[:self.rank])
                share = [(index, (self.seed, step, first + position)) for position, index in enumerate(share)]
            yield share
