"""kronfluence's EK-FAC pairwise scores for a benchmark setting (peers.py runs it).

The training loss is each row's loss summed over the batch; with ``sample`` (the true Fisher) the
targets are drawn from the model: a class from the softmax, a token per position, or for mean
squared error a Gaussian around the prediction (kronfluence's own UCI regression example). The
measurement is the reference's loss. A GPT-2 ``Conv1D`` becomes the ``Linear`` it is, and the
blocks' projections are tracked (as benchmarks/peers_curvature.py); elsewhere every Linear.
"""

from __future__ import annotations

import math
import tempfile

import numpy as np
import torch
from setting import Setting
from torch import nn

BLOCKS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def _linear_lm(model: nn.Module) -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Conv1D):  # y = x W + b with W (in, out): a Linear with W^T
                linear = nn.Linear(*child.weight.shape)
                linear.weight.data, linear.bias.data = child.weight.data.T.clone(), child.bias.data
                setattr(module, name, linear)
    return model


def _sampled(s: Setting, outputs: torch.Tensor, targets):
    with torch.no_grad():
        if s.loss == "mse":
            return torch.normal(outputs, std=math.sqrt(0.5))
        probs = outputs.reshape(-1, outputs.shape[-1]).softmax(-1)
        drawn = torch.multinomial(probs, 1).view(outputs.shape[:-1])
        if s.lm:  # positions without a label keep none
            shifted = torch.cat([drawn[:, -1:], drawn[:, :-1]], 1)  # label t predicts from t-1
            return torch.where(targets == -100, targets, shifted)
        return drawn


def pairwise(s: Setting, ref: list, model: nn.Module, damping: float | None) -> np.ndarray:
    """(R, N) scores, positive where the training row lowers the reference's loss."""
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task
    from kronfluence.utils.dataset import DataLoaderKwargs

    if s.lm:
        model = _linear_lm(model)
    if isinstance(model, nn.Linear):  # kronfluence wraps tracked modules: a bare one loops
        model = nn.Sequential(model)
    tracked = (
        [f"transformer.h.{i}.{m}" for i in range(len(model.transformer.h)) for m in BLOCKS]
        if s.lm
        else None
    )

    class SettingTask(Task):
        def compute_train_loss(self, batch, model, sample=False):
            outputs, targets = s.forward(model, batch)
            if sample:
                targets = _sampled(s, outputs, targets)
            return s.per_example_loss(outputs, targets).sum()

        def compute_measurement(self, batch, model):
            return s.per_example_loss(*s.forward(model, batch)).sum()

        def get_influence_tracked_modules(self):
            return tracked

        def get_attention_mask(self, batch):
            return batch["attention_mask"] if s.lm else None

    task = SettingTask()
    model = prepare_model(model, task)
    train = s.rows()
    with tempfile.TemporaryDirectory() as tmp:
        analyzer = Analyzer("bench", model, task, cpu=True, output_dir=tmp, disable_tqdm=True)
        analyzer.set_dataloader_kwargs(DataLoaderKwargs(collate_fn=s.collate))
        analyzer.fit_all_factors("ekfac", train, per_device_batch_size=64,
                                 factor_args=FactorArguments(strategy="ekfac"),
                                 overwrite_output_dir=True)  # fmt: skip
        analyzer.compute_pairwise_scores("pair", "ekfac", ref, train,
                                         per_device_query_batch_size=64,
                                         per_device_train_batch_size=64,
                                         score_args=ScoreArguments(damping_factor=damping),
                                         overwrite_output_dir=True)  # fmt: skip
        scores = analyzer.load_pairwise_scores("pair")["all_modules"]  # (R, N)
    return scores.double().numpy()
