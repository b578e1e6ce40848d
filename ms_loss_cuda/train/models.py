"""Embedding networks for the training command: a torchvision backbone (when torchvision imports;
weights from a local file, nothing is downloaded), a small built-in convnet, or a linear/MLP head
over precomputed features. Each maps its input to [B, dim] unnormalised embeddings (the loss
normalises), and `freeze_batchnorm` keeps batch-norm statistics fixed, as the authors train."""
import pickle

import torch
from torch import nn

BUILT_IN = ("convnet", "linear", "mlp")  # SmallConvNet and FeatureHead's two forms; other names are torchvision's


class SmallConvNet(nn.Module):
    """Four 3 x 3 conv blocks (conv, batch-norm, ReLU, 2 x 2 max-pool), global average pooling and a
    linear embedding: a CPU-sized backbone for small images (the kanji experiment's 32 x 32)."""

    def __init__(self, dim=128, in_channels=1, width=32):
        super().__init__()
        layers, channels = [], in_channels
        for out in (width, 2 * width, 4 * width, 8 * width):
            layers += [nn.Conv2d(channels, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True),
                       nn.MaxPool2d(2)]
            channels = out
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.embedding = nn.Linear(channels, dim)

    def forward(self, images):
        return self.embedding(self.features(images))


class FeatureHead(nn.Module):
    """A head over frozen features: linear (hidden=0) or a one-hidden-layer MLP."""

    def __init__(self, in_features, dim=128, hidden=0):
        super().__init__()
        self.net = (nn.Linear(in_features, dim) if hidden == 0 else
                    nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, dim)))

    def forward(self, features):
        return self.net(features)


def torchvision_backbone(name, dim, weights=None):
    """torchvision model `name` (e.g. resnet50) with its classifier replaced by a linear embedding of
    size `dim`; `weights` a local state_dict file of the torchvision model (nothing is downloaded)."""
    try:
        import torchvision
    except Exception as error:  # not installed, or built for another torch
        raise RuntimeError(f"backbone {name!r} is not built in ({', '.join(BUILT_IN)}), so it names a torchvision "
                           f"model, and torchvision does not import here ({error}); use a built-in backbone, or "
                           "install a torchvision that matches torch") from error
    if name.lower() not in torchvision.models.list_models():
        raise ValueError(f"backbone {name!r} is neither built in ({', '.join(BUILT_IN)}) nor a torchvision model "
                         "(torchvision.models.list_models() names them)")
    model = torchvision.models.get_model(name, weights=None)
    if weights is not None:
        try:
            state = torch.load(weights, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, pickle.UnpicklingError):  # (torch's advice to unpickle anything is left out)
            raise ValueError(f"{weights}: not a file of tensors that torch.load reads as plain data") from None
        try:
            model.load_state_dict(state)
        except (RuntimeError, TypeError, AttributeError) as error:  # (another model's weights, or not a dict)
            raise ValueError(f"{weights}: not a state_dict of torchvision's {name} ({error})") from None
    for attribute in ("fc", "classifier", "head", "heads"):  # the last layer's name differs by family
        if hasattr(model, attribute):
            last = getattr(model, attribute)
            linears = [m for m in ([last] if isinstance(last, nn.Linear) else last.modules()) if isinstance(m, nn.Linear)]
            setattr(model, attribute, nn.Linear(linears[-1].in_features, dim))
            return model
    raise ValueError(f"torchvision model {name!r}: no fc/classifier/head layer to replace with the embedding")


def freeze_batchnorm(model):
    """Batch-norm layers in eval mode with fixed affine parameters (call after every model.train())."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()
            for parameter in module.parameters():
                parameter.requires_grad_(False)
    return model
