"""Offline real data for the experiment: kanji drawn from KanjiVG's stroke paths (the `kanjivg` PyPI
package, CC BY-SA 3.0, https://kanjivg.tagaini.net), each character a class, each instance the same
strokes rendered with random jitter (a global affine, every stroke shifted and scaled on its own,
random pen width).

Only base characters are used (no `-Kaisho`-style variant files): 6,703 classes. The split follows
SOP's protocol: the classes are shuffled once with a fixed seed, the first half trains and the
unseen second half is the retrieval test set.
"""
import hashlib
import importlib.metadata
import os
import re

import numpy as np

VIEWBOX = 109.0  # KanjiVG's drawing area is 109 x 109 units
_TOKEN = re.compile(r"[MmCcSsLl]|[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_PATH = re.compile(r'<path[^>]*\sd="([^"]+)"')
_CURVE_SAMPLES = np.linspace(0.0, 1.0, 9)[1:]  # points per cubic segment (the start is the previous end)


def svg_directory():
    """The folder of KanjiVG's SVG files inside the installed `kanjivg` package."""
    try:
        folder = importlib.metadata.distribution("kanjivg").locate_file("kanji")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError("the kanji data needs the kanjivg package: pip install kanjivg") from None
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"kanjivg is installed but its SVG folder is missing: {folder}")
    return str(folder)


def _cubic(p0, p1, p2, p3):
    t = _CURVE_SAMPLES[:, None]
    return (1 - t) ** 3 * p0 + 3 * (1 - t) ** 2 * t * p1 + 3 * (1 - t) * t ** 2 * p2 + t ** 3 * p3


def path_points(d, where="path"):
    """A polyline [N, 2] from an SVG path's `d` (the commands KanjiVG uses: M, C, S, L, absolute or
    relative, with implicit repeats). `where` names the file for errors."""
    tokens = _TOKEN.findall(d)
    points, i, command = [], 0, None
    pen = control = np.zeros(2)

    def take(n):
        nonlocal i
        if i + n > len(tokens) or any(t.isalpha() for t in tokens[i:i + n]):
            raise ValueError(f"{where}: path command {command!r} needs {n} numbers: {d!r}")
        values = np.array(tokens[i:i + n], dtype=np.float64).reshape(-1, 2)
        i += n
        return values + (pen if command.islower() else 0.0)

    while i < len(tokens):
        if tokens[i].isalpha():
            command, i = tokens[i], i + 1
        elif command is None:
            raise ValueError(f"{where}: path does not start with a command: {d!r}")
        kind = command.upper()
        if kind == "M":
            pen = control = take(2)[0]
            points.append(pen[None])
            command = "l" if command == "m" else "L"  # numbers after a moveto are linetos
        elif kind == "L":
            pen = control = take(2)[0]
            points.append(pen[None])
        elif kind == "C":
            c1, c2, end = take(6)
            points.append(_cubic(pen, c1, c2, end))
            pen, control = end, c2
        else:  # S: the first control point mirrors the previous curve's second
            c2, end = take(4)
            points.append(_cubic(pen, 2 * pen - control, c2, end))
            pen, control = end, c2
    if not points:
        raise ValueError(f"{where}: empty path")
    return np.concatenate(points)


def read_strokes(file):
    """The strokes of one KanjiVG file: a list of polylines in 0..109 units."""
    with open(file, encoding="utf-8") as handle:
        paths = _PATH.findall(handle.read())
    if not paths:
        raise ValueError(f"{file}: no <path d=...> strokes found")
    return [path_points(d, file) for d in paths]


def characters(folder=None):
    """The base characters' files, sorted by code point (variant files such as 04e00-Kaisho.svg left out)."""
    folder = folder or svg_directory()
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if re.fullmatch(r"[0-9a-f]+\.svg", f))


def render(strokes, rng, size=32, jitter=1.0, supersample=2):
    """One jittered drawing of `strokes`, uint8 [size, size] (white on black)."""
    from PIL import Image, ImageDraw

    canvas = size * supersample
    angle = rng.normal(0.0, 0.10 * jitter)
    scale = rng.uniform(0.80, 1.0) * np.exp(rng.normal(0.0, 0.06 * jitter, 2))
    shear = rng.normal(0.0, 0.10 * jitter)
    rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    matrix = rotation @ np.array([[1.0, shear], [0.0, 1.0]]) * scale[None, :]
    offset = rng.normal(0.0, 3.0 * jitter, 2)
    image = Image.new("L", (canvas, canvas))
    draw = ImageDraw.Draw(image)
    width = max(1, round(rng.uniform(3.0, 5.5) * canvas / VIEWBOX))
    for points in strokes:
        centre = points.mean(axis=0)
        own = 1.0 + rng.normal(0.0, 0.08 * jitter)  # each stroke moves and stretches on its own
        moved = (points - centre) * own + centre + rng.normal(0.0, 2.0 * jitter, 2)
        xy = ((moved - VIEWBOX / 2) @ matrix.T + VIEWBOX / 2 + offset) * (canvas / VIEWBOX)
        draw.line([tuple(p) for p in xy], fill=255, width=width, joint="curve")
    return np.asarray(image.resize((size, size), Image.BILINEAR if supersample == 1 else Image.BOX))


def render_set(files, per_class, *, size=32, seed=0, jitter=1.0):
    """(images uint8 [len(files) * per_class, size, size], labels int64): per_class drawings of each
    file; label = the file's position in `files`."""
    images = np.empty((len(files) * per_class, size, size), dtype=np.uint8)
    for label, file in enumerate(files):
        strokes = read_strokes(file)
        rng = np.random.default_rng([seed, label])
        for k in range(per_class):
            images[label * per_class + k] = render(strokes, rng, size, jitter)
    return images, np.repeat(np.arange(len(files)), per_class)


def split(files, seed=0):
    """SOP's protocol: (train files, test files), half the classes each, disjoint."""
    order = np.random.default_rng(seed).permutation(len(files))
    half = len(files) // 2
    return [files[i] for i in sorted(order[:half])], [files[i] for i in sorted(order[half:])]


def load(cache_dir, *, train_per_class=8, test_per_class=5, size=32, jitter=1.8, classes=None, seed=0):
    """{"train": (images, labels), "test": (images, labels)}, rendered once and cached as .npz under
    `cache_dir` (the key holds every setting). jitter 1.8 looks like hurried handwriting. `classes` limits the number of characters (for quick
    runs); None takes all."""
    files = characters()
    if classes is not None and not 2 <= classes <= len(files):
        raise ValueError(f"classes must be from 2 (half train, half test) to {len(files):,} (KanjiVG's characters), "
                         f"got {classes}")
    if classes is not None:
        files = files[:: max(1, len(files) // classes)][:classes]
    key = hashlib.sha1(repr((len(files), files[-1], train_per_class, test_per_class, size, jitter, seed)).encode()).hexdigest()
    path = os.path.join(cache_dir, f"kanji-{key[:12]}.npz")
    if os.path.exists(path):
        with np.load(path) as data:
            return {"train": (data["train_x"], data["train_y"]), "test": (data["test_x"], data["test_y"])}
    train_files, test_files = split(files, seed)
    train = render_set(train_files, train_per_class, size=size, seed=seed, jitter=jitter)
    test = render_set(test_files, test_per_class, size=size, seed=seed + 1, jitter=jitter)
    os.makedirs(cache_dir, exist_ok=True)
    part = f"{path}.{os.getpid()}.tmp.npz"  # (processes rendering at once, as torchrun's, each write their own)
    try:
        np.savez(part, train_x=train[0], train_y=train[1], test_x=test[0], test_y=test[1])
        os.replace(part, path)
    finally:
        if os.path.exists(part):  # (a write that failed part-way)
            os.remove(part)
    return {"train": train, "test": test}
