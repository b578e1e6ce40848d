"""The kanji experiment's runner (bench/experiment_runs.py): runs grouped by setting in seed order,
one at a time or several at once; two runs never share a folder; a failed run stops the experiment
with the end of its log. And the sizes at which the GPU version times the loss alone
(bench/experiment_gpu.py), which stops at once where no GPU is visible."""
import argparse
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import experiment_gpu  # noqa: E402
import experiment_runs  # noqa: E402
import kanji_experiment  # noqa: E402


def _args(tmp_path, jobs, seeds=(0, 1), extra=()):
    return argparse.Namespace(out=str(tmp_path), data=str(tmp_path / "data"), seeds=list(seeds), jobs=jobs,
                              evaluations=0, device="cpu", extra=list(extra))


@pytest.mark.parametrize("jobs", [1, 3])
def test_runs_are_grouped_by_setting_in_seed_order(tmp_path, monkeypatch, jobs):
    def fake_run(name, batch, extra, steps, seed, args, log=None):
        time.sleep(0.01 * (3 - seed))  # (later seeds finish first when they run at once)
        return {"name": name, "batch": batch, "steps": steps, "seed": seed, "logged": log is not None}

    monkeypatch.setattr(experiment_runs, "run_setting", fake_run)
    settings = {"batch 8": (8, []), "batch 32 + memory 64": (32, ["--memory-size", "64"])}
    runs = experiment_runs.run_settings(settings, lambda batch: 1000 // batch, _args(tmp_path, jobs, (0, 1, 2)))
    assert list(runs) == list(settings)
    for name, (batch, _) in settings.items():
        assert [r["seed"] for r in runs[name]] == [0, 1, 2]
        assert {(r["name"], r["batch"], r["steps"], r["logged"]) for r in runs[name]} == {
            (name, batch, 1000 // batch, jobs > 1)}


def test_two_runs_may_not_share_a_folder(tmp_path):
    settings = {"batch 8 (chunks of 2)": (8, ["--chunk-size", "2"]),
                "batch 8 (chunks of 4)": (8, ["--chunk-size", "4"])}
    with pytest.raises(ValueError, match="share a folder"):
        experiment_runs.run_settings(settings, lambda batch: 1, _args(tmp_path, 2))


def test_a_failed_run_stops_the_runs_with_the_end_of_its_log(tmp_path):
    settings = {"batch 8": (8, [])}  # (an argument the training command refuses: it exits at once)
    with pytest.raises(RuntimeError, match="unrecognized arguments: --no-such-option"):
        experiment_runs.run_settings(settings, lambda batch: 1, _args(tmp_path, 2, extra=["--no-such-option"]))


def test_the_loss_is_timed_at_the_settings_sizes_and_the_memories_share_one_batch():
    sizes = experiment_gpu.loss_sizes(experiment_gpu.SETTINGS)
    assert sizes == ([128, 512, 2048, 8192, experiment_gpu.LARGEST], [16384, experiment_gpu.WHOLE_SPLIT], 2048)
    assert experiment_gpu.loss_sizes({"batch 64": (64, [])}) == ([64], [], 0)
    with pytest.raises(SystemExit, match="one batch size"):
        experiment_gpu.loss_sizes({"a": (512, ["--memory-size", "4096"]), "b": (2048, ["--memory-size", "4096"])})


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_the_gpu_version_without_a_gpu_stops_before_rendering(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(experiment_gpu, "render_once", lambda *a: pytest.fail("rendered without a GPU"))
    monkeypatch.setattr(sys, "argv", ["kanji_experiment.py", "--device", "cuda", "--out", str(tmp_path / "out"),
                                      "--data", str(tmp_path / "data")])
    with pytest.raises(SystemExit) as stop:
        kanji_experiment.main()
    assert stop.value.code == 2 and "sees no CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()
