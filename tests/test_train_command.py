"""The training command end to end on small data: outputs, resume, features, memory with gradient
caching, and two processes (gloo) against one; its help, its checks of --ks against the test set,
and its refusal of a checkpoint that is not plain data."""
import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

import ms_loss_cuda

for _module in ("numpy", "PIL", "tqdm", "matplotlib"):  # the training extras (a GPU machine may lack them)
    pytest.importorskip(_module)
import numpy as np  # noqa: E402
import ms_loss_cuda.train.__main__ as command  # noqa: E402
from ms_loss_cuda.train.__main__ import main, write_metrics  # noqa: E402
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
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 6
    printed = capsys.readouterr().out
    assert "recall@1:" in printed
    # 48 characters, half of them train and half test: 24 x 4 training and 24 x 3 test drawings
    assert "train set: 96 images of 24 classes; test set: 72 images of 24 classes" in printed


def test_resume_continues_the_same_run(tmp_path):
    """3 steps, then a resume to 6, end exactly where an uninterrupted 6-step run ends."""
    common = ("--schedule", "constant", "--memory-size", 40, "--chunk-size", 12)
    whole = main(_kanji_args(tmp_path / "whole", tmp_path / "cache", "--steps", 6, "--eval-every", 3, *common))
    main(_kanji_args(tmp_path / "parts", tmp_path / "cache", "--steps", 3, *common))
    resumed = main(_kanji_args(tmp_path / "parts", tmp_path / "cache", "--steps", 6, "--resume", *common))
    assert [row["step"] for row in resumed] == [0, 3, 6]
    for key in ("train_loss", "recall@1", "map_at_r"):
        assert resumed[-1][key] == pytest.approx(whole[-1][key], rel=1e-6)
    a = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "parts" / "checkpoint.pt", weights_only=True)
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor)
    torch.testing.assert_close(b["memory"]["embeddings"], a["memory"]["embeddings"])
    # another setting than the checkpoint's is refused: its optimiser would restore the old learning rate
    with pytest.raises(SystemExit, match=r"made with --lr 0.001 \(now 0.5\), --memory-size 40 \(now 64\)"):
        main(_kanji_args(tmp_path / "parts", tmp_path / "cache", "--steps", 7, "--resume", *common, "--lr", 0.5,
                         "--memory-size", 64))


def _interrupted(argv, at_step, monkeypatch):
    """main(argv), stopped as if killed right after it wrote the checkpoint of step `at_step`."""
    written = command.checkpoint.save

    def save(state, path):
        written(state, path)
        if state["step"] == at_step:
            raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(command.checkpoint, "save", save)
        with pytest.raises(KeyboardInterrupt):
            main(argv)


def test_a_run_resumed_between_evaluations_records_the_whole_interval(tmp_path, monkeypatch):
    """Killed after step 2's checkpoint (--checkpoint-every, no evaluation there), resumed: the row of
    step 6 averages all six steps' losses, as the uninterrupted run's does."""
    common = ("--steps", 6, "--checkpoint-every", 2, "--schedule", "cosine")
    whole = main(_kanji_args(tmp_path / "whole", tmp_path / "cache", *common))
    _interrupted(_kanji_args(tmp_path / "parts", tmp_path / "cache", *common), 2, monkeypatch)
    resumed = main(_kanji_args(tmp_path / "parts", tmp_path / "cache", *common, "--resume"))
    assert [row["step"] for row in resumed] == [0, 6]
    for key in ("train_loss", "mined", "recall@1", "map_at_r"):
        assert resumed[-1][key] == pytest.approx(whole[-1][key], rel=1e-6)


def test_more_steps_on_resume_follow_the_new_schedule(tmp_path, monkeypatch, capsys):
    """A 3-step cosine run resumed with --steps 6 takes the 6-step schedule's rates from step 3 on
    (not the 3-step schedule's last, 0), and may change --ks."""
    rates = []
    step = torch.optim.Adam.step
    monkeypatch.setattr(torch.optim.Adam, "step", lambda self, *a, **k: (rates.append(self.param_groups[0]["lr"]),
                                                                         step(self, *a, **k))[1])
    main(_kanji_args(tmp_path / "whole", tmp_path / "cache", "--steps", 6))
    whole, rates[:] = list(rates), []
    main(_kanji_args(tmp_path / "parts", tmp_path / "cache", "--steps", 3))
    assert "holds an earlier run" not in capsys.readouterr().out
    main(_kanji_args(tmp_path / "parts", tmp_path / "cache", "--steps", 6, "--resume", "--ks", 1, 5))
    assert rates[3:] == whole[3:] and rates[3] > 0
    assert "recall@1:" in capsys.readouterr().out
    main(_kanji_args(tmp_path / "parts", tmp_path / "cache", "--steps", 1))  # (a new run over the old one)
    assert f"note: {tmp_path / 'parts' / 'checkpoint.pt'} holds an earlier run" in capsys.readouterr().out


def test_the_console_script_exits_with_status_0(tmp_path, monkeypatch):
    """A console script exits with its function's result: None is status 0 (main's history would be 1)."""
    scripts = importlib.metadata.entry_points(group="console_scripts", name="ms-loss-train")
    if not scripts:
        pytest.skip("ms-loss-cuda is not installed (its source folder is on the path)")
    monkeypatch.setattr(sys, "argv", ["ms-loss-train", *_kanji_args(tmp_path / "run", tmp_path / "cache", "--steps", 1)])
    assert next(iter(scripts)).load()() is None
    assert (tmp_path / "run" / "metrics.json").exists()


def test_options_a_run_never_reads_are_noted_and_mining_off_uses_every_pair(tmp_path, capsys):
    history = main(_kanji_args(tmp_path / "run", tmp_path / "cache", "--steps", 1, "--no-mining", "--epsilon", 0.3,
                               "--gamma", 0.5, "--memory-warmup", 2, "--workers", 2, "--hidden", 64))
    assert history[-1]["mined"] == 1.0
    notes = capsys.readouterr().err.splitlines()
    assert notes == ["note: --workers has no effect without --data sop or folders",
                     "note: --hidden has no effect without --backbone mlp",
                     "note: --gamma has no effect without --schedule step",
                     "note: --epsilon has no effect without mining (it is off: --no-mining)",
                     "note: --memory-warmup has no effect without --memory-size"]
    command.options.parse_args(["--schedule", "step", "--gamma", "0.5", "--milestones", "0.5"])
    assert capsys.readouterr().err == ""


def test_undefined_metrics_are_written_as_null(tmp_path):
    """MAP@R of a test set whose classes are single rows is NaN: null in metrics.json, which stays JSON."""
    write_metrics([{"step": 0, "precision_at_1": 0.0, "map_at_r": float("nan")}], str(tmp_path))
    assert json.loads((tmp_path / "metrics.json").read_text()) == [{"step": 0, "precision_at_1": 0.0,
                                                                    "map_at_r": None}]


def test_features_with_a_head(tmp_path):
    """Classes live in 8 of 24 dimensions, the other 16 are loud noise: a head that learns to drop
    them on the training classes retrieves the unseen test classes better. (--ks without 1: the
    Recall@1 plot still has its points.)"""
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
                    "--steps", "80", "--lr", "1e-2", "--ks", "5", "--out", str(tmp_path / "run"), "--no-progress",
                    "--backend", BACKEND])
    assert history[-1]["map_at_r"] > 2 * history[0]["map_at_r"] + 0.1
    assert "recall@1" not in history[-1] and (tmp_path / "run" / "recall.png").exists()


def test_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit, match="needs --root"):
        main(["--data", "sop", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):  # argparse's usage error (exit status 2)
        main(_kanji_args(tmp_path / "run", tmp_path / "cache", "--steps", 1, "--batch-size", 30))
    assert "--batch-size (30) must be a positive multiple of --per-class (4)" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"a batch of 400 with 4 per class needs 100"):  # (48 classes)
        main(_kanji_args(tmp_path / "few", tmp_path / "cache", "--steps", 1, "--batch-size", 400))
    assert not (tmp_path / "few" / "checkpoint.pt").exists()  # (refused before the first evaluation)
    with pytest.raises(SystemExit, match="--amp bf16 is mixed precision on CUDA; on cpu pass --amp off"):
        main(_kanji_args(tmp_path / "run", tmp_path / "cache", "--steps", 1, "--amp", "bf16", "--device", "cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: this torch .* sees no CUDA GPU"):
            main(_kanji_args(tmp_path / "run", tmp_path / "cache", "--steps", 1, "--device", "cuda"))
    for device, message in (("gpu", "--device gpu: Expected one of"), ("meta", "--device meta: the command trains on cpu")):
        with pytest.raises(SystemExit, match=message):
            main(_kanji_args(tmp_path / "run", tmp_path / "cache", "--steps", 1, "--device", device))
    with pytest.raises(SystemExit, match="--backend cuda does not run on cpu in this install; the backends that do: "):
        main(_kanji_args(tmp_path / "late", tmp_path / "cache", "--steps", 1, "--device", "cpu") + ["--backend", "cuda"])
    assert not (tmp_path / "late").exists()  # (refused before the first evaluation)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit, match="--out .*a-file is a file: the command writes a folder there"):
        main(_kanji_args(tmp_path / "a-file", tmp_path / "cache", "--steps", 1))
    np.save(tmp_path / "bare.npy", np.zeros((8, 4), dtype=np.float32))
    torch.save({"feats": torch.zeros(8, 4), "targets": torch.zeros(8)}, tmp_path / "keys.pt")
    torch.save(np.zeros((8, 4)), tmp_path / "pickled.pt")
    for name, message in (("bare.npy", "holds a bare array; pass its labels file too"),
                          ("keys.pt", r"must hold 'features' and 'labels'.*it holds \['feats', 'targets'\]"),
                          ("pickled.pt", r"pickled.pt is not plain data .* numpy[^\n]*refused and never constructed$")):
        with pytest.raises(SystemExit, match=message):
            main(["--data", "features", "--train-features", str(tmp_path / name), "--test-features",
                  str(tmp_path / name), "--out", str(tmp_path / "run")])
    with pytest.raises(SystemExit, match="Ebay_train.txt, which does not exist"):
        main(["--data", "sop", "--root", str(tmp_path), "--out", str(tmp_path / "run")])
    with pytest.raises(SystemExit, match="nope.pt, which does not exist"):
        main(["--data", "features", "--train-features", str(tmp_path / "nope.pt"), "--test-features",
              str(tmp_path / "nope.pt"), "--out", str(tmp_path / "run")])
    capsys.readouterr()
    for option, value, message in (("--ks", 0, "--ks: every k must be at least 1"),
                                   ("--steps", 0, "--steps must be at least 1, got 0"),
                                   ("--seed", -1, "--seed must be at least 0, got -1"),
                                   ("--per-class", 1, "--per-class must be at least 2, got 1"),
                                   ("--warmup-steps", -3, "--warmup-steps must be at least 0, got -3"),
                                   ("--lr", "nan", "--lr must be a finite number > 0, got nan"),
                                   ("--memory-weight", -1, "--memory-weight must be a finite number >= 0"),
                                   ("--alpha", -1, "--alpha must be at least float32's smallest normal number"),
                                   ("--kanji-classes", -5, "--kanji-classes must be at least 2, got -5"),
                                   ("--kanji-test-instances", 1, "--kanji-test-instances must be at least 2"),
                                   ("--kanji-jitter", "nan", "--kanji-jitter must be a finite number >= 0, got nan"),
                                   ("--milestones", 1.5, "--milestones are fractions of --steps, each from 0 to 1"),
                                   ("--image-size", 8, "--image-size 8: the convnet halves its input four times"),
                                   ("--memory-size", 16, "--memory-size (16) must be at least --batch-size (32)"),
                                   ("--weights", "w.pt", "--weights loads a torchvision backbone's state_dict; "
                                                         "--backbone convnet is built in")):
        with pytest.raises(SystemExit):  # argparse's usage error (exit status 2), before any data is read
            main(_kanji_args(tmp_path / "run", tmp_path / "cache", "--steps", 1, option, value))
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--backbone resnt18 is not built in .* which takes RGB images: use it with "
                                         "--data sop or folders"):  # (a misspelt name too, before torchvision is asked)
        main(_kanji_args(tmp_path / "run", tmp_path / "cache", "--steps", 1, "--backbone", "resnt18"))
    with pytest.raises(SystemExit):
        main(_kanji_args(tmp_path / "run", tmp_path / "cache", "--steps", 1, "--backbone", "resnet18", "--weights",
                         tmp_path / "nope.pth"))
    assert f"--weights {tmp_path / 'nope.pth'} does not exist" in capsys.readouterr().err
    # a misspelt backbone: named as neither built in nor torchvision's (or as needing a torchvision that imports)
    with pytest.raises((RuntimeError, ValueError), match="backbone 'resnt18' is (not|neither) built in"):
        command.models.torchvision_backbone("resnt18", 8)


def _features(path, labels, dim=4):
    torch.save({"features": torch.randn(len(labels), dim, generator=torch.Generator().manual_seed(0)),
                "labels": torch.tensor(labels)}, path)
    return str(path)


def test_feature_sets_and_their_classes_are_checked(tmp_path, capsys):
    """Test features of another size, and sets whose classes are single images: refused where no
    class has two (nothing to train on, or nothing to retrieve), named where some do."""
    def run(train, test, steps=1):
        return main(["--data", "features", "--train-features", train, "--test-features", test, "--batch-size", "4",
                     "--per-class", "2", "--steps", str(steps), "--ks", "1", "--out", str(tmp_path / "run"),
                     "--no-progress", "--backend", BACKEND])

    pairs, singles = [0, 0, 1, 1, 2, 2, 3], [0, 1, 2, 3]
    with pytest.raises(SystemExit, match="holds features of 5 dimensions; the training features have 4"):
        run(_features(tmp_path / "a.pt", pairs), _features(tmp_path / "b.pt", pairs, dim=5))
    with pytest.raises(SystemExit, match="the train set has no class of two or more images: the loss has no positive"):
        run(_features(tmp_path / "c.pt", singles), _features(tmp_path / "d.pt", pairs))
    with pytest.raises(SystemExit, match="the test set has no class of two or more images: leave-one-out retrieval"):
        run(_features(tmp_path / "e.pt", pairs), _features(tmp_path / "f.pt", singles))
    with pytest.raises(SystemExit, match="the test set has one class: every neighbour is of the query's class"):
        run(_features(tmp_path / "e.pt", pairs), _features(tmp_path / "one.pt", [7, 7, 7]))
    with pytest.raises(SystemExit, match=r"features must be a float \[N, D\] array \(D >= 1\), got .*\(7, 0\)"):
        run(_features(tmp_path / "empty.pt", pairs, dim=0), _features(tmp_path / "d.pt", pairs))
    for backbone, message in (("convnet", "--backbone convnet takes images: use --backbone linear or mlp"),
                              ("Linear", "--backbone Linear is not built in .* so it names a torchvision model")):
        with pytest.raises(SystemExit, match=message):
            main(["--data", "features", "--train-features", str(tmp_path / "e.pt"), "--test-features",
                  str(tmp_path / "d.pt"), "--backbone", backbone, "--ks", "1", "--out", str(tmp_path / "run"),
                  "--no-progress"])
    history = run(_features(tmp_path / "g.pt", pairs), _features(tmp_path / "h.pt", [0, 0, 1, 1, 2]), steps=2)
    printed = capsys.readouterr().out
    assert "note: 1 training class(es) of one image: they have no positive pair" in printed
    assert "note: 1 test image(s) alone in their class count as misses in Recall@K" in printed
    assert history[-1]["step"] == 2


def test_missing_training_extras_are_named_when_the_command_is_imported():
    import subprocess
    import sys

    code = "import sys; sys.modules['tqdm'] = None; import ms_loss_cuda.train.__main__"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode != 0
    assert 'ImportError: the training command needs tqdm, which is not installed: pip install ' \
           '"ms-loss-cuda[train]"' in run.stderr


def _help_entries(text):
    """{option: its help text, one line} from argparse's help output."""
    entries, current = {}, None
    for line in text.splitlines():
        if line.startswith("  -"):
            invocation, _, rest = line.strip().partition("  ")
            current = invocation.split()[0].rstrip(",")
            entries[current] = rest.strip()
        elif current is not None and line.startswith("    ") and line.strip():
            entries[current] = (entries[current] + " " + line.strip()).strip()
        else:
            current = None
    return entries


def test_help_gives_every_option_a_help_line_and_its_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as stopped:
        main(["--help"])
    assert stopped.value.code == 0
    entries = _help_entries(capsys.readouterr().out)
    entries.pop("-h")
    assert {"--data", "--steps", "--lr", "--alpha", "--beta", "--out", "--ks", "--resume"} <= set(entries)
    for option, text in entries.items():
        help_line, _, shown = text.partition("(default: ")
        assert len(help_line.split()) >= 2 and shown.endswith(")"), f"{option}: {text!r}"
    expected = {"--steps": "1000", "--lr": "0.001", "--alpha": "2.0", "--beta": "50.0", "--out": "runs/train",
                "--ks": "1 10 100 1000", "--freeze-bn": "off", "--no-mining": "mining on"}
    for option, default in expected.items():
        assert entries[option].endswith(f"(default: {default})"), entries[option]


def test_check_ks_allows_the_test_set_size_minus_one():
    command.check_ks((1, 71), 72)  # leave-one-out: each of 72 queries ranks the other 71
    with pytest.raises(SystemExit, match=r"--ks 72 is larger than the test set allows: it has 72 images"):
        command.check_ks((1, 72), 72)
    with pytest.raises(SystemExit, match=r"the test set has 1 image\(s\): leave-one-out evaluation needs at least 2"):
        command.check_ks((1,), 1)


def test_ks_beyond_the_test_set_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    """The test set is 24 classes x 3 drawings = 72 images: --ks 72 is refused as soon as the data
    is loaded, --ks 71 runs (evaluation ranks each query against the other 71)."""
    build_model = command.build_model

    def refuse_to_build(*arguments):
        raise AssertionError("the model is built before --ks is checked against the test set")

    monkeypatch.setattr(command, "build_model", refuse_to_build)
    with pytest.raises(SystemExit, match=r"--ks 72 .* 72 images, .* other 71, so every k must be at most 71 "
                                         r"\(e\.g\. --ks 1 10\)"):
        main(_kanji_args(tmp_path / "run", tmp_path / "cache", "--steps", 1, "--ks", 1, 10, 72))
    monkeypatch.setattr(command, "build_model", build_model)
    history = main(_kanji_args(tmp_path / "run", tmp_path / "cache", "--steps", 1, "--ks", 1, 71))
    assert history[-1]["recall@71"] == 1.0  # 71 neighbours of 72 include every other drawing of the class


class Payload:
    """An object whose unpickling runs code: __setstate__ writes the file it names."""

    def __init__(self, marker):
        self.marker = marker

    def __setstate__(self, state):
        pathlib.Path(state["marker"]).write_text("ran")


def test_resume_refuses_a_checkpoint_that_is_not_plain_data(tmp_path):
    out, marker = tmp_path / "run", tmp_path / "payload-ran"
    out.mkdir()
    torch.save({"model": {}, "step": 1, "history": [], "payload": Payload(str(marker))}, out / "checkpoint.pt")
    with pytest.raises(SystemExit) as refused:
        main(_kanji_args(out, tmp_path / "cache", "--steps", 2, "--resume"))
    message = str(refused.value)
    assert f"--resume: {out / 'checkpoint.pt'} is not plain data" in message and "Payload" in message
    assert not marker.exists()
    torch.load(out / "checkpoint.pt", weights_only=False)  # the same file loaded as arbitrary pickle runs it
    assert marker.read_text() == "ran"
    for state in ({"model": {"weight": torch.zeros(2)}, "step": 1, "history": []}, torch.zeros(3)):
        torch.save(state, out / "checkpoint.pt")
        with pytest.raises(SystemExit, match="checkpoint.pt is not a checkpoint of this run"):
            main(_kanji_args(out, tmp_path / "cache", "--steps", 2, "--resume"))
    whole = (out / "checkpoint.pt").read_bytes()
    for broken in (b"", whole[:len(whole) // 2], b"step 1\n"):  # empty, cut short, not torch.save's
        (out / "checkpoint.pt").write_bytes(broken)
        with pytest.raises(SystemExit, match="checkpoint.pt is not a file that torch.save wrote, or it is cut short"):
            main(_kanji_args(out, tmp_path / "cache", "--steps", 2, "--resume"))


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
    about 0 moves by up to lr on its rounding alone."""
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
    a = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=True)["model"]
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
    def run(workers, root=tmp_path, *more):
        return main(["--data", layout, "--root", str(root), "--image-size", "16", "--width", "4", "--dim", "8",
                     "--batch-size", "8", "--per-class", "2", "--steps", "2", "--ks", "1", "--workers", str(workers),
                     "--eval-batch", "5", "--out", str(tmp_path / f"run{workers}"), "--no-progress", "--backend", BACKEND,
                     *more])

    history = run(1)
    assert [row["step"] for row in history] == [0, 2] and 0 <= history[-1]["recall@1"] <= 1
    # each sample's crop and flip come from its key (seed, step, position), not from a worker's generator
    assert [{**row, "train_seconds": 0} for row in run(0)] == [{**row, "train_seconds": 0} for row in history]
    # a resume may read the same data from another folder, but not other data
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path, moved, ignore=shutil.ignore_patterns("run*"))
    assert [row["step"] for row in run(0, moved, "--steps", "3", "--resume")] == [0, 2, 3]
    (moved / "train" / "class5" / "2.png").rename(moved / "train" / "class4" / "9.png")
    (moved / "Ebay_train.txt").write_text((moved / "Ebay_train.txt").read_text().replace("class5/2", "class4/9"))
    with pytest.raises(SystemExit, match=f"was made on other data than this run's under --root {re.escape(str(moved))} "):
        run(0, moved, "--steps", "4", "--resume")
