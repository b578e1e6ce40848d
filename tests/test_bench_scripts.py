"""The benchmark scripts end to end on CPU at tiny sizes: bench/benchmark.py (what `make demo` and
`make bench` run, each provider in a process of its own) and bench/memory_benchmark.py write a result
row per provider, each measured."""
import importlib.util
import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def run(script, *args):
    done = subprocess.run([sys.executable, os.path.join(BENCH, script), *map(str, args)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads((args[-1] / "results.json").read_text())["results"]


def test_the_benchmark_measures_every_provider(tmp_path):
    rows = run("benchmark.py", "--sizes", 8, "--dim", 16, "--providers", "floor", "cpu", "--repeats", 1,
               "--max-seconds", 1, "--out", tmp_path)
    assert [(r["provider"], r["batch"], r["status"]) for r in rows] == [("floor", 8, "ok"), ("cpu", 8, "ok")]
    assert all(r["seconds"] > 0 for r in rows)
    assert {"results.csv", "results.png"} <= set(os.listdir(tmp_path))


def test_the_memory_benchmark_measures_every_provider(tmp_path):
    providers = ["ours"] + ["pml"] * (importlib.util.find_spec("pytorch_metric_learning") is not None)
    rows = run("memory_benchmark.py", "--size", 64, "--batch", 16, "--dim", 8, "--repeats", 1, "--providers",
               *providers, "--out", tmp_path)
    assert [r["provider"] for r in rows] == providers and all(r["seconds"] > 0 for r in rows), rows
