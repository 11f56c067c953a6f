"""Small MLP classifier for the 8x8 scikit-learn digits."""

import torch
from torch import nn


class DigitsMLP(nn.Module):
    """Two-hidden-layer MLP mapping (B, 64) pixels in [0, 1] to (B, 10) logits."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
