"""The benchmark's only reach into the Triton backend's internals: its tile table, for the
triton-tuned providers (--tuned tune.json, the winners of bench/tune_triton.py's sweep)."""
import json


def with_tiles(step, table):
    """`step` with the triton backend's tile table (launcher.tile_config, read by every launch plan)
    replaced by `table` during the call."""
    from ms_loss_cuda.triton_kernels import launcher

    def run(x):
        shipped, launcher.tile_config = launcher.tile_config, table
        try:
            step(x)
        finally:
            launcher.tile_config = shipped

    return run


def tuned_from(path, dtype):
    """(tile table, what it holds) from a sweep of bench/tune_triton.py for `dtype` ("float32-tf32": none,
    the sweep runs float32 at torch's default precision); (None, why) when the sweep has no winner for it."""
    import tune_triton  # (bench/, this module's folder)

    try:
        with open(path) as f:
            found = tune_triton.winners(json.load(f), dtype)
    except (OSError, ValueError) as error:
        return None, f"{path} unreadable: {error}"
    if not found:
        return None, f"{path} has no winners for {dtype}"
    return tune_triton.tuned_table(found), {kind: repr(config) for kind, config in found.items()}
