"""The training application: data readers and the P x M sampler (`data`), the offline kanji data
(`kanji`), embedding networks (`models`), plain-data checkpoints (`checkpoint`) and the command
`python -m ms_loss_cuda.train` (also installed as `ms-loss-train`), which needs the [train] extras
(`pip install "ms-loss-cuda[train]"`). The library (`ms_loss_cuda` itself: the loss, the memory,
the distributed loss, evaluation, gradient caching) never imports this package."""
