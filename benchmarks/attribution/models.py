"""Model factories of the attribution benchmark's settings that torch does not ship as one class."""

import torch
from torch import nn


class Regressor(nn.Module):
    """One-hidden-layer tanh MLP mapping (B, features) to (B, 1) predictions."""

    def __init__(self, features: int = 10, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
