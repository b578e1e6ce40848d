"""The training application: data readers and the P x M sampler (`data`), the offline kanji data
(`kanji`), embedding networks (`models`) and the command `python -m ms_loss_cuda.train` (also
installed as `ms-loss-train`). The library (`ms_loss_cuda` itself: the loss, the memory, the
distributed loss, evaluation, gradient caching) never imports this package."""
