"""Triton kernels of the MS loss (installed as ms_loss_cuda.triton_kernels)."""
