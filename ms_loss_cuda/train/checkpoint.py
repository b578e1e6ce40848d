"""The training command's checkpoint: plain data only, so loading one never runs code.

A checkpoint holds tensors, dicts, lists, tuples, ints, floats, bools, strings and None: the state
dicts of the model, optimizer, schedule, gradient scaler and memory, the step, the metrics history,
the command's arguments and the random-number generators' states (as uint8 tensors). `load` reads it
with `torch.load(..., weights_only=True)`, which refuses any other pickled object instead of
constructing it; such a file, and one that torch.save did not write, is reported by its path.
A resumed run must keep the checkpoint's settings (`changed_settings`) and its data (`data_digest`).
"""
import hashlib
import os
import pickle
import re

import numpy as np
import torch

__all__ = ["changed_settings", "data_digest", "load", "restore_rng", "rng_state", "save"]


def rng_state(device):
    """{"cpu": torch's CPU generator state, "cuda": `device`'s generator state or None}, uint8 tensors."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def restore_rng(states, device):
    """Sets the generators to `states` (from rng_state); the CUDA one only when both sides are CUDA."""
    torch.set_rng_state(states["cpu"].cpu())
    if states.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)


def save(state, path):
    """Writes `state` to `path` whole, then renames it into place: an interrupted save never leaves a
    broken file behind."""
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def load(path, device="cpu"):
    """The checkpoint (or any plain-data torch.save file) at `path`, tensors on `device`. A file that
    holds anything beyond plain data, or that torch.save did not write (empty, cut short, another
    format), raises ValueError naming the path; objects are refused, never constructed."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's message advises loading the file as arbitrary pickle; only its finding is kept.
        text = str(error)
        finding = text.split("WeightsUnpickler error:", 1)[1] if "WeightsUnpickler error:" in text else ""
        finding = next((line.strip() for line in finding.splitlines() if line.strip()), "")
        found = re.search(r"Unsupported global: GLOBAL (\S+)", finding)
        holds = (f"it holds a pickled {found.group(1)}, which is refused and never constructed" if found else
                 f"a plain-data load refuses it ({finding or 'not a torch.save file'})")
        raise ValueError(f"{path} is not plain data (tensors, dicts, lists, numbers and strings only): "
                         f"{holds}") from None
    except (FileNotFoundError, PermissionError, MemoryError):
        raise
    except Exception as error:  # (torch.load's reader fails in many ways on what torch.save did not write)
        raise ValueError(f"{path} is not a file that torch.save wrote, or it is cut short ({type(error).__name__}: "
                         f"{error})") from None


# What a resumed run may change: the run's length, its output and evaluation (steps: a run is
# extended by resuming it with more), and where its data lies (root: `data_digest` checks the data
# is the same). Every other setting is the checkpoint's: its optimiser and schedule would restore
# theirs over a new --lr, and a new batch, model or data would not fit them.
FREE = {"steps", "resume", "out", "eval_every", "eval_batch", "ks", "checkpoint_every", "no_progress", "workers",
        "device", "root"}


def same_setting(a, b):
    """Whether two values of an option are the same (a list of values equal to a tuple of them: argparse
    gives a list where the default is a tuple, and a checkpoint's settings come back as lists)."""
    return list(a) == list(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b


def changed_settings(saved, args):
    """The options of `args` (a dict) that differ from the checkpoint's `saved` ones, as "--name OLD
    (now NEW)", but for FREE; none where the checkpoint records no options."""
    return [f"--{name.replace('_', '-')} {saved[name]} (now {value})" for name, value in sorted(args.items())
            if name not in FREE and name in (saved or {}) and not same_setting(saved[name], value)]


def data_digest(datasets, root=None):
    """A SHA-256 digest (hex) of the data a run trains and evaluates on, which its checkpoint keeps: a
    resumed run whose data differs (--root, which a resume may change, naming another data set, or
    images added, removed or relabelled under it) is refused, while the same data moved to another
    folder resumes. It covers each set's labels in order and its images' paths relative to `root`
    (the images themselves are not read: that would take a pass over the data set), or, for samples
    held in memory (kanji drawings, features), their shape; those come from settings a resume keeps."""
    digest = hashlib.sha256()
    for dataset in datasets:
        labels = np.asarray(dataset.labels, dtype=np.int64)
        digest.update(f"{len(labels)} labels\n".encode())
        digest.update(labels.tobytes())
        paths = getattr(dataset, "paths", None)
        if paths is not None:
            digest.update("\n".join(os.path.relpath(path, root) for path in paths).encode())
        else:
            digest.update(f"samples {tuple(dataset.inputs.shape)}\n".encode())
    return digest.hexdigest()
