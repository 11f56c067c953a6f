"""The true Fisher's labels: targets drawn from the model's own predictive distribution.

The Fisher F = E_x E_{y ~ p(y|x)} [g g^T] needs output gradients of losses whose targets are
sampled from the model; the empirical Fisher takes the data's targets instead. The targets are
drawn (``SampledLoss.sample``) from a generator seeded per batch, from a forward of their own
before the engine's pass, which then takes them as the batch's targets (``SampledLoss.scaled``):
the engine's checks that run an example alone see the labels drawn for it in the batch, where a
loss drawing them itself drew others for a batch of one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError
from ..losses import LossFn, check_class_dim, counted

FISHERS = ("true", "empirical")
# losses whose targets the model's output is a distribution over
SAMPLED = ("cross_entropy", "nll", "causal_lm", "bce_with_logits", "mse")


def check_fisher(fisher: str, loss_name: str) -> None:
    if fisher not in FISHERS:
        raise ConfigError(f"--fisher must be true or empirical, got {fisher!r}", "--fisher")
    if fisher == "true" and loss_name not in SAMPLED:
        raise ConfigError(
            f"the true Fisher samples targets from the model's predictive distribution, which "
            f"loss {loss_name!r} does not define; use --fisher empirical",
            "loss.name",
        )


def _categorical(probs: Tensor, generator: torch.Generator) -> Tensor:
    """One class per row of (N, C) probabilities; any class for a row of NaN or inf (its loss
    is NaN then, and the factors leave the example out)."""
    usable = torch.isfinite(probs).all(-1, keepdim=True) & (probs.sum(-1, keepdim=True) > 0)
    return torch.multinomial(torch.where(usable, probs, 1.0), 1, generator=generator)[:, 0]


class SampledLoss:
    """``loss(output, sampled targets)`` for the named loss, with the targets drawn from the
    output: softmax over the classes (cross_entropy, causal_lm's next token), exp of log-probs
    (nll), a Bernoulli of the sigmoid (bce_with_logits). Positions whose target is
    ``ignore_index`` keep it.

    mse: an example's loss over D elements, ``(1/D) sum_d (o_d - t_d)^2`` (``token_reduction``
    mean; sum: without 1/D), is the negative log-likelihood of a Gaussian of variance D/2 (sum:
    1/2) around the output, up to a constant, so the true Fisher is ``E[g g^T]`` with
    ``g = (2/D)(o - t)`` over that Gaussian: ``(2/D) I``, the Hessian of the loss w.r.t. the
    output, so that the Fisher is the Gauss-Newton matrix. The targets are ``o + sqrt(D/2) r``
    with r of random signs (Rademacher): the same second moment, so the same expectation, and
    each draw's ``g_d^2 = 2/D`` exactly (one output: every draw gives the GGN, no noise).
    The other losses' means over positions are scaled as ``_positions`` says.
    """

    def __init__(
        self,
        name: str,
        loss: LossFn,
        kwargs: dict,
        class_dim: int,
        seed: int = 0,
        token_reduction: str = "mean",
    ):
        self.name, self.loss, self.class_dim, self.seed = name, loss, class_dim, seed
        self.ignore_index = kwargs.get("ignore_index", -100)
        self.token_reduction = token_reduction

    def __call__(self, output: Tensor, targets: Tensor) -> Tensor:
        """The loss at targets drawn from ``output`` itself (a batch's draws, not each
        example's alone: ``sample`` before the pass, then ``scaled``, for the engine)."""
        return self.scaled(output, self.sample(output.detach(), targets))

    def scaled(self, output: Tensor, drawn: Tensor) -> Tensor:
        """(B,) the loss at the ``drawn`` targets, each example's mean over positions scaled
        as ``_positions`` says."""
        loss = self.loss(output, drawn)  # (B,)
        if self.token_reduction == "sum" or self.name == "mse":
            return loss
        return loss * self._positions(output, drawn).sqrt()

    def _positions(self, output: Tensor, drawn: Tensor) -> Tensor:
        """(B,) the positions each example's loss is the mean over (those that count).

        An example's mean over T positions, ``(1/T) sum_t l_t``, has the Gauss-Newton matrix
        ``(1/T) sum_t F_t`` (F_t the Fisher of position t), while its sampled gradient's
        second moment is ``(1/T^2) sum_t F_t``: positions' draws are independent, so their
        cross terms vanish. Each sampled loss is scaled by sqrt(T) so that the sampled Fisher
        is the Gauss-Newton matrix again, rows of every length alike.
        """
        batch = len(output)
        counts = counted(self.name, drawn, self.ignore_index)  # (B, ...) drawn ids or elements
        count = counts.reshape(batch, -1).sum(1).clamp_min(1)  # (B,)
        return count.to(output.dtype if output.is_floating_point() else torch.float32)

    def sample(self, output: Tensor, targets: Tensor) -> Tensor:
        g = torch.Generator(device=output.device).manual_seed(self.seed)
        out = output if output.dtype == torch.float64 else output.float()
        if self.name == "mse":
            elements = out[0].numel() if self.token_reduction == "mean" else 1  # D
            bits = torch.randint(0, 2, out.shape, generator=g, device=out.device)
            drawn = out + (bits.to(out.dtype) * 2 - 1) * (elements / 2) ** 0.5
            return drawn.to(output.dtype).reshape(targets.shape)
        if self.name == "bce_with_logits":
            drawn = torch.bernoulli(out.sigmoid().nan_to_num(0.5), generator=g)
            return drawn.to(targets.dtype if targets.is_floating_point() else out.dtype)
        if self.name == "causal_lm":  # logits at 0..T-2 predict the tokens at 1..T-1
            logits = out[:, :-1]  # (B, T-1, V)
            drawn = _categorical(logits.reshape(-1, logits.shape[-1]).softmax(-1), g)
            sampled = targets.clone()
            keep = targets[:, 1:] == self.ignore_index
            sampled[:, 1:] = torch.where(keep, targets[:, 1:], drawn.view(keep.shape))
            return sampled
        # cross_entropy / nll: classes along class_dim (dim 1 of a (B, C) output)
        if out.dim() > 2:  # the data's targets tell a class_dim that does not fit
            check_class_dim(self.name, out, targets, self.class_dim)
        dim = 1 if out.dim() <= 2 else self.class_dim % out.dim()
        scores = out.movedim(dim, -1)  # (B, ..., C)
        probs = scores.exp() if self.name == "nll" else scores.softmax(-1)
        drawn = _categorical(probs.reshape(-1, probs.shape[-1]), g).view(scores.shape[:-1])
        if targets.is_floating_point() or drawn.shape != targets.shape:
            return drawn  # class probabilities as targets: sampled classes replace them
        return torch.where(targets == self.ignore_index, targets.long(), drawn)
