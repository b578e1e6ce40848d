"""ms_loss_cuda: the Multi-Similarity loss, fused (no B x B similarity matrix in memory)."""
from . import reference
from .loss import MultiSimilarityLoss, available_backends, multi_similarity_loss
from .memory import CrossBatchMemory

__all__ = ["CrossBatchMemory", "MultiSimilarityLoss", "available_backends", "multi_similarity_loss", "reference"]
__version__ = "0.1.0"
