"""A small CNN trained on the real digits: it judges samples (accuracy against the requested
class) and its penultimate layer is the FID feature space (Inception features mean little on
8x8 scans upscaled)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from .digits_data import NUM_CLASSES


class DigitClassifier(nn.Module):
    """Three convolutions, global average pooling (any input size), a `width`-d feature layer."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(64, width, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, width), nn.ReLU(),
        )
        self.head = nn.Linear(width, NUM_CLASSES)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        return self.body(images)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


class FIDFeatures(nn.Module):
    """The FID feature network: uint8 RGB (B, 3, H, W) -> the classifier's penultimate features.

    Grey level back to [-1, 1] and resized to the classifier's resolution, so torchmetrics'
    probe image (299 x 299) and the samples go through the same path.
    """

    def __init__(self, classifier: DigitClassifier, resolution: int):
        super().__init__()
        self.classifier, self.resolution = classifier.eval(), resolution
        self.num_features = classifier.head.in_features

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        grey = images.float().mean(1, keepdim=True) / 127.5 - 1.0
        if grey.shape[-2:] != (self.resolution, self.resolution):
            grey = F.interpolate(grey, size=(self.resolution, self.resolution), mode="bilinear", antialias=True, align_corners=False)
        return self.classifier.features(grey).double()


def shift(images: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Random translation by up to `max_shift` pixels (the scans are not perfectly centred)."""
    if max_shift == 0:
        return images
    dy, dx = (int(v) for v in torch.randint(-max_shift, max_shift + 1, (2,), generator=generator))
    return torch.roll(images, shifts=(dy, dx), dims=(-2, -1))


def train_classifier(images, labels, *, steps: int, batch_size: int = 128, lr: float = 2e-3, seed: int = 0,
                     device="cpu", progress: bool = True) -> DigitClassifier:
    """Adam on cross-entropy with small random shifts; returns the model in eval mode."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = DigitClassifier().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    max_shift = images.shape[-1] // 8
    images, labels = images.to(device), labels.to(device)
    for _ in tqdm(range(steps), desc="classifier", disable=not progress, mininterval=2):
        idx = torch.randint(0, len(labels), (batch_size,), generator=generator).to(device)
        loss = F.cross_entropy(model(shift(images[idx], max_shift, generator)), labels[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model.eval()


@torch.no_grad()
def probabilities(model: DigitClassifier, images: torch.Tensor, batch_size: int = 1000) -> torch.Tensor:
    device = next(model.parameters()).device
    return torch.cat([model(chunk.to(device)).softmax(1).cpu() for chunk in images.split(batch_size)])


def predict(model: DigitClassifier, images: torch.Tensor) -> torch.Tensor:
    return probabilities(model, images).argmax(1)


def accuracy(model: DigitClassifier, images: torch.Tensor, labels: torch.Tensor) -> float:
    return float((predict(model, images) == labels.cpu()).float().mean())


def confidence(model: DigitClassifier, images: torch.Tensor) -> float:
    """Mean top-class probability: how legibly each image is one digit, where no digit was asked for."""
    return float(probabilities(model, images).max(1).values.mean())
