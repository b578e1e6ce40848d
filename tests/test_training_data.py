"""The training application's data: the readers (SOP, folders, features) and their errors, the
authors' transforms, the P x M sampler (alone and shared by several processes), and the kanji data."""
import importlib.metadata

import pytest
import torch

np = pytest.importorskip("numpy")  # the training extras (a GPU machine may lack them)
PIL = pytest.importorskip("PIL.Image")
from ms_loss_cuda.train import data, kanji  # noqa: E402


def _image(path, size=(40, 30), value=0):
    PIL.new("RGB", size, (value, 100, 200)).save(path)


# ---- readers ------------------------------------------------------------------------------------
def _sop(root, lines):
    (root / "images").mkdir(exist_ok=True)
    for line in lines:  # (the listed images exist; their content is not read)
        if len(line.split()) == 4:
            (root / line.split()[3]).touch()
    for split in ("train", "test"):
        with open(root / f"Ebay_{split}.txt", "w") as handle:
            handle.write("image_id class_id super_class_id path\n" + "".join(l + "\n" for l in lines))
    return root


def test_read_sop(tmp_path):
    root = _sop(tmp_path, ["1 1 1 images/a.jpg", "2 1 1 images/b.jpg", "", "3 7 2 images/c.jpg"])
    paths, labels = data.read_sop(str(root), "test")
    assert paths == [str(root / "images" / n) for n in ("a.jpg", "b.jpg", "c.jpg")]
    assert labels.tolist() == [0, 0, 6]


@pytest.mark.parametrize("line", ["4 x 1 images/d.jpg", "4 2 1", "4 0 1 images/d.jpg", "4 \u00b2 1 images/d.jpg",
                                  f"4 {2 ** 63 + 1} 1 images/d.jpg"])
def test_read_sop_names_the_bad_line(tmp_path, line):
    root = _sop(tmp_path, ["1 1 1 images/a.jpg", line])
    with pytest.raises(ValueError, match=r"Ebay_train.txt:3: expected"):
        data.read_sop(str(root))


def test_read_sop_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="Ebay_train.txt"):
        data.read_sop(str(tmp_path))
    (tmp_path / "Ebay_train.txt").write_text("id class path\n")
    with pytest.raises(ValueError, match="Ebay_train.txt:1: expected the header"):
        data.read_sop(str(tmp_path))
    with pytest.raises(ValueError, match="split"):
        data.read_sop(str(tmp_path), "val")
    root = _sop(tmp_path, ["1 1 1 images/a.jpg", "2 1 1 images/b.jpg", "3 2 1 images/c.jpg"])
    (root / "images" / "b.jpg").unlink()
    with pytest.raises(FileNotFoundError, match=r"Ebay_train.txt: 1 of the 3 images it lists do not exist "
                                                r"\(the first: .*images/b.jpg\)"):
        data.read_sop(str(root))


def test_read_folders(tmp_path):
    for name, count in (("b", 2), ("a", 1)):
        (tmp_path / name).mkdir()
        for i in range(count):
            _image(tmp_path / name / f"{i}.png")
    (tmp_path / "b" / "notes.txt").write_text("not an image")
    (tmp_path / "b" / "._0.png").write_bytes(b"\0")  # (hidden: a macOS copy's metadata, and a notebook's folder)
    (tmp_path / ".ipynb_checkpoints").mkdir()
    paths, labels, classes = data.read_folders(str(tmp_path))
    assert classes == ["a", "b"] and labels.tolist() == [0, 1, 1]
    assert paths[0].endswith("a/0.png")
    (tmp_path / "c").mkdir()
    with pytest.raises(ValueError, match="c: no images"):
        data.read_folders(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="missing"):
        data.read_folders(str(tmp_path / "missing"))


def test_read_features(tmp_path):
    x, y = np.random.default_rng(0).normal(size=(6, 3)).astype(np.float32), np.arange(6) % 2
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    torch.save({"features": torch.from_numpy(x).double(), "labels": torch.from_numpy(y)}, tmp_path / "both.pt")
    for features, labels in ((tmp_path / "x.npy", tmp_path / "y.npy"), (tmp_path / "both.pt", None)):
        got_x, got_y = data.read_features(str(features), None if labels is None else str(labels))
        assert got_x.dtype == torch.float32 and got_y.dtype == torch.int64
        torch.testing.assert_close(got_x, torch.from_numpy(x))
        assert got_y.tolist() == y.tolist()
    np.save(tmp_path / "short.npy", y[:5])
    with pytest.raises(ValueError, match="short.npy: labels must be 6 integers"):
        data.read_features(str(tmp_path / "x.npy"), str(tmp_path / "short.npy"))
    with pytest.raises(ValueError, match="pass its labels file"):
        data.read_features(str(tmp_path / "x.npy"))
    with pytest.raises(FileNotFoundError, match="nope.npy"):
        data.read_features(str(tmp_path / "x.npy"), str(tmp_path / "nope.npy"))
    x[4, 1] = np.nan
    np.save(tmp_path / "nan.npy", x)
    with pytest.raises(ValueError, match=r"nan.npy: features must be finite; 1 row\(s\) hold NaN .* row 4"):
        data.read_features(str(tmp_path / "nan.npy"), str(tmp_path / "y.npy"))
    (tmp_path / "x.csv").write_text("1,2\n")
    with pytest.raises(ValueError, match=r"x.csv: features and labels are read from \.npy or \.pt"):
        data.read_features(str(tmp_path / "x.csv"), str(tmp_path / "y.npy"))


def test_image_dataset_transforms(tmp_path):
    _image(tmp_path / "a.png", (60, 40), value=30)
    (tmp_path / "broken.png").write_text("not an image")
    labels = torch.tensor([3, 4])
    train = data.ImageDataset([str(tmp_path / "a.png"), str(tmp_path / "broken.png")], labels, size=24, train=True)
    image, label, index = train[0]
    assert image.shape == (3, 24, 24) and label == 3 and index == 0
    test = data.ImageDataset([str(tmp_path / "a.png")], labels, size=24)
    first, second = test[0][0], test[0][0]
    torch.testing.assert_close(first, second)  # the test transform is deterministic
    red = (30 / 255 - data.MEAN[0]) / data.STD[0]
    torch.testing.assert_close(first[0], torch.full((24, 24), red))
    with pytest.raises(ValueError, match="broken.png: cannot read the image"):
        train[1]


# ---- the P x M sampler ----------------------------------------------------------------------------
def _labels():
    # 30 classes of 1..9 samples, shuffled: small classes must be topped up with replacement
    counts = [1 + i % 9 for i in range(30)]
    labels = np.repeat(np.arange(30), counts)
    return torch.from_numpy(np.random.default_rng(0).permutation(labels))


@pytest.mark.parametrize("batch_size,per_class", [(40, 4), (36, 3), (120, 4)])
def test_batches_are_p_classes_of_m(batch_size, per_class):
    labels = _labels()
    sampler = data.ClassBalancedBatches(labels, batch_size, per_class, steps=5, seed=1)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 5
    for batch in batches:
        assert len(batch) == batch_size
        classes, counts = np.unique(labels[batch].numpy(), return_counts=True)
        assert len(classes) == batch_size // per_class and (counts == per_class).all()
        for c in classes:  # distinct samples whenever the class has enough
            picked = [i for i in batch if labels[i] == c]
            if (labels == c).sum() >= per_class:
                assert len(set(picked)) == per_class
    assert batches[0] != batches[1]


def test_processes_share_every_global_batch():
    labels = _labels()
    whole = list(data.ClassBalancedBatches(labels, 40, 4, steps=3, seed=2))
    for world in (2, 3):
        shares = [list(data.ClassBalancedBatches(labels, 40, 4, steps=3, seed=2, rank=r, world_size=world))
                  for r in range(world)]
        for step in range(3):
            assert sum((shares[r][step] for r in range(world)), []) == whole[step]
            assert max(len(shares[r][step]) for r in range(world)) - min(len(shares[r][step]) for r in range(world)) <= 1
    resumed = list(data.ClassBalancedBatches(labels, 40, 4, steps=3, seed=2, start=1))
    assert resumed == whole[1:]


def test_sampler_errors():
    labels = _labels()
    with pytest.raises(ValueError, match=r"batch size \(30\) must be a positive multiple of the samples per class \(4\)"):
        data.ClassBalancedBatches(labels, 30, 4, steps=1)
    with pytest.raises(ValueError, match="needs 31 classes; the data has 30"):
        data.ClassBalancedBatches(labels, 124, 4, steps=1)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        data.ClassBalancedBatches(labels, 40, 4, steps=1, rank=2, world_size=2)


def test_sampler_batches_in_the_thousands():
    labels = torch.arange(20000) // 5
    batch = next(iter(data.ClassBalancedBatches(labels, 8192, 4, steps=1)))
    assert len(set(batch)) == 8192 and np.bincount(labels[batch].numpy()).max() == 4


# ---- kanji ----------------------------------------------------------------------------------------
def test_path_points():
    points = kanji.path_points("M10,20c1,0,2,0,3,0s4,0,5,0L30,40m1,1")
    np.testing.assert_allclose(points[0], [10, 20])
    np.testing.assert_allclose(points[8], [13, 20])  # the end of the relative curve
    np.testing.assert_allclose(points[16], [18, 20])  # the smooth curve continues from the pen
    np.testing.assert_allclose(points[-2:], [[30, 40], [31, 41]])
    with pytest.raises(ValueError, match="x.svg: path command 'c' needs 6 numbers"):
        kanji.path_points("M1,2c1,2,3", "x.svg")
    with pytest.raises(ValueError, match="does not start with a command"):
        kanji.path_points("1,2")


def test_kanji_sets(tmp_path):
    try:  # kanjivg ships data only, no module to import
        importlib.metadata.distribution("kanjivg")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs the kanjivg package")
    files = kanji.characters()
    assert len(files) > 6000
    train, test = kanji.split(files)
    assert not set(train) & set(test) and len(train) + len(test) == len(files)
    sets = kanji.load(str(tmp_path), train_per_class=3, test_per_class=2, size=24, classes=20)
    (x, y), (tx, ty) = sets["train"], sets["test"]
    assert x.shape == (30, 24, 24) and x.dtype == np.uint8 and tx.shape == (20, 24, 24) and ty.shape == (20,)
    assert y.tolist() == np.repeat(np.arange(10), 3).tolist()
    assert (x.reshape(30, -1).max(axis=1) > 100).all()  # every drawing has strokes
    assert not np.array_equal(x[0], x[1])  # instances of a class differ
    assert [p.name.count(".") for p in tmp_path.iterdir()] == [1]  # one cache file, its part renamed into place
    again = kanji.load(str(tmp_path), train_per_class=3, test_per_class=2, size=24, classes=20)  # from the cache
    np.testing.assert_array_equal(again["train"][0], x)
    with pytest.raises(ValueError, match=f"classes must be from 2 .* to {len(files):,} .*, got {len(files) + 1}"):
        kanji.load(str(tmp_path), classes=len(files) + 1)
