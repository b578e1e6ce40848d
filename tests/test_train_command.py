"""The training command end to end on small data: outputs, resume, features, memory with gradient
caching, and two processes (gloo) against one."""
import importlib.metadata
import json
import os
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import ms_loss_cuda
from ms_loss_cuda.train.__main__ import main

for _module in ("PIL", "tqdm", "matplotlib"):  # the training extras (a GPU machine may lack them)
    pytest.importorskip(_module)
try:  # kanjivg ships data only (a kanji/ folder), no module to import
    importlib.metadata.distribution("kanjivg")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("the kanji data needs the kanjivg package", allow_module_level=True)
BACKEND = "cpu" if "cpu" in ms_loss_cuda.available_backends("cpu") else "reference"


def _kanji_args(out, cache, *extra):
    return ["--data", "kanji", "--root", str(cache), "--kanji-classes", "48", "--kanji-train-instances", "4",
            "--kanji-test-instances", "3", "--image-size", "16", "--width", "4", "--dim", "16", "--batch-size", "32",
            "--per-class", "4", "--ks", "1", "10", "--out", str(out), "--no-progress", "--backend", BACKEND,
            *map(str, extra)]


def test_kanji_run_writes_metrics_plot_and_checkpoint(tmp_path, capsys):
    history = main(_kanji_args(tmp_path / "run", tmp_path / "cache", "--steps", 6, "--eval-every", 3, "--lr", 3e-3))
    assert [row["step"] for row in history] == [0, 3, 6]
    assert [row["images_seen"] for row in history] == [0, 96, 192]
    for row in history[1:]:
        assert row["train_loss"] > 0 and 0 <= row["mined"] <= 1
        assert 0 <= row["recall@1"] <= row["recall@10"] <= 1
    out = tmp_path / "run"
    assert json.loads((out / "metrics.json").read_text()) == history
    assert (out / "metrics.csv").read_text().splitlines()[0].startswith("step,images_seen,train_loss,mined")
    assert (out / "recall.png").stat().st_size > 0
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 6
    assert "recall@1:" in capsys.readouterr().out


def test_resume_continues_the_same_run(tmp_path):
    """3 steps, then a resume to 6, end exactly where an uninterrupted 6-step run ends."""
    common = ("--schedule", "constant", "--memory-size", 40, "--chunk-size", 12)
    whole = main(_kanji_args(tmp_path / "whole", tmp_path / "cache", "--steps", 6, "--eval-every", 3, *common))
    main(_kanji_args(tmp_path / "parts", tmp_path / "cache", "--steps", 3, *common))
    resumed = main(_kanji_args(tmp_path / "parts", tmp_path / "cache", "--steps", 6, "--resume", *common))
    assert [row["step"] for row in resumed] == [0, 3, 6]
    for key in ("train_loss", "recall@1", "map_at_r"):
        assert resumed[-1][key] == pytest.approx(whole[-1][key], rel=1e-6)
    a = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "parts" / "checkpoint.pt", weights_only=False)
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor)
    torch.testing.assert_close(b["memory"]["embeddings"], a["memory"]["embeddings"])


def test_features_with_a_head(tmp_path):
    """Classes live in 8 of 24 dimensions, the other 16 are loud noise: a head that learns to drop
    them on the training classes retrieves the unseen test classes better."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(40, 8))
    for split, classes in (("train", range(20)), ("test", range(20, 40))):
        labels = np.repeat(np.array(list(classes)), 6)
        features = np.concatenate([centres[labels] + 0.3 * rng.normal(size=(len(labels), 8)),
                                   2.0 * rng.normal(size=(len(labels), 16))], axis=1)
        torch.save({"features": torch.from_numpy(features).float(), "labels": torch.from_numpy(labels)},
                   tmp_path / f"{split}.pt")
    history = main(["--data", "features", "--train-features", str(tmp_path / "train.pt"), "--test-features",
                    str(tmp_path / "test.pt"), "--backbone", "mlp", "--hidden", "32", "--dim", "8", "--batch-size", "40",
                    "--steps", "80", "--lr", "1e-2", "--ks", "1", "--out", str(tmp_path / "run"), "--no-progress",
                    "--backend", BACKEND])
    assert history[-1]["map_at_r"] > 2 * history[0]["map_at_r"] + 0.1


def test_bad_arguments(tmp_path):
    with pytest.raises(SystemExit, match="needs --root"):
        main(["--data", "sop", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=r"batch size \(30\) must be a positive multiple"):
        main(_kanji_args(tmp_path / "run", tmp_path / "cache", "--steps", 1, "--batch-size", 30))
    with pytest.raises(FileNotFoundError, match="Ebay_train.txt"):
        main(["--data", "sop", "--root", str(tmp_path), "--out", str(tmp_path / "run")])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, argv):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    main(argv)


def test_two_processes_train_like_one(tmp_path):
    """torchrun's environment, gloo: with batch-norm frozen, two processes sharing each batch take the
    steps one process takes (the same losses and weights, to float32 rounding). SGD, whose step is
    linear in the gradient: Adam's divides by the gradient's own size, so a weight whose gradient is
    about 0 moves by up to lr on its rounding alone (5e-4 of 0.09 after 4 steps, seen)."""
    common = ("--steps", 4, "--eval-every", 2, "--freeze-bn", "--memory-size", 64, "--schedule", "constant",
              "--optimizer", "sgd", "--lr", 0.05)
    main(_kanji_args(tmp_path / "cache" / "warm", tmp_path / "cache", "--steps", 1))  # render once
    one = main(_kanji_args(tmp_path / "one", tmp_path / "cache", *common))
    port = _free_port()
    argv = _kanji_args(tmp_path / "two", tmp_path / "cache", *common)
    context = mp.get_context("spawn")
    processes = [context.Process(target=_rank, args=(rank, 2, port, argv)) for rank in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=240)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in processes] == [0, 0]
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert [row["step"] for row in two] == [0, 2, 4]
    for a, b in zip(one[1:], two[1:]):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
    a = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=False)["model"]
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)


def test_the_library_never_imports_the_application():
    import subprocess
    import sys

    code = ("import sys, ms_loss_cuda, ms_loss_cuda.distributed, ms_loss_cuda.evaluation, ms_loss_cuda.gradient_cache; "
            "print(sorted(m for m in sys.modules if m.startswith('ms_loss_cuda.train')))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


@pytest.mark.parametrize("layout", ["folders", "sop"])
def test_image_data_end_to_end(tmp_path, layout):
    """Images on disk through the readers, the authors' transforms and a DataLoader with a worker."""
    from PIL import Image

    rng = np.random.default_rng(0)
    lines = {"train": [], "test": []}
    for split, classes in (("train", range(6)), ("test", range(6, 10))):
        for c in classes:
            folder = tmp_path / split / f"class{c}"
            folder.mkdir(parents=True)
            for k in range(3):
                pixels = (rng.random((20, 24, 3)) * 60 + c * 20).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{k}.png")
                lines[split].append(f"{len(lines[split]) + 1} {c + 1} 1 {split}/class{c}/{k}.png")
    for split in ("train", "test"):
        (tmp_path / f"Ebay_{split}.txt").write_text("image_id class_id super_class_id path\n" + "\n".join(lines[split]))
    history = main(["--data", layout, "--root", str(tmp_path), "--image-size", "16", "--width", "4", "--dim", "8",
                    "--batch-size", "8", "--per-class", "2", "--steps", "2", "--ks", "1", "--workers", "1",
                    "--eval-batch", "5", "--out", str(tmp_path / "run"), "--no-progress", "--backend", BACKEND])
    assert [row["step"] for row in history] == [0, 2] and 0 <= history[-1]["recall@1"] <= 1
