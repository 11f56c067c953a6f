"""The exact influence function by its definition, for the tests: the GGN or Hessian over the
flattened selected parameters built whole with torch.func, solved with torch.linalg.solve, and
each example's gradient from its own backward."""

from __future__ import annotations

import torch
from oracle import assert_rel_close
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev


def curvature_matrix(model: nn.Module, loss, names, x: Tensor, y: Tensor, kind: str) -> Tensor:
    """(P, P): the GGN (1/N) sum_i J_i^T H_i J_i, or the Hessian of the mean loss."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    shapes = [params[n].shape for n in names]
    theta = torch.cat([params[n].flatten() for n in names])

    def output(t: Tensor, inputs: Tensor) -> Tensor:
        parts, start = {}, 0
        for n, s in zip(names, shapes, strict=True):
            parts[n] = t[start : start + s.numel()].view(s)
            start += s.numel()
        return functional_call(model, {**params, **parts}, (inputs,))

    if kind == "hessian":
        return hessian(lambda t: loss(output(t, x), y).mean())(theta)
    jac = jacrev(output)(theta, x)  # (N, *O, P)
    out = output(theta, x).detach()
    total = torch.zeros(theta.numel(), theta.numel(), dtype=theta.dtype)
    for i in range(len(y)):
        h = hessian(lambda o, i=i: loss(o[None], y[i : i + 1])[0])(out[i])  # (*O, *O)
        j = jac[i].reshape(-1, theta.numel())  # (O, P)
        total += j.T @ h.reshape(j.shape[0], j.shape[0]) @ j
    return total / len(y)


def per_example_grads(model: nn.Module, loss, names, x: Tensor, y: Tensor) -> Tensor:
    """(N, P) each example's loss gradient over ``names``, one backward each."""
    params = dict(model.named_parameters())
    rows = []
    for i in range(len(y)):
        value = loss(model(x[i : i + 1]), y[i : i + 1])[0]
        grads = torch.autograd.grad(value, [params[n] for n in names], allow_unused=True)
        rows.append(
            torch.cat([
                (g if g is not None else torch.zeros_like(params[n])).flatten()
                for n, g in zip(names, grads, strict=True)
            ])
        )  # fmt: skip
    return torch.stack(rows)


def exact_scores(
    model,
    loss,
    names,
    x,
    y,
    x_ref,
    y_ref,
    kind: str,
    factor: float,
    per_ref: bool = False,
    lam: float | None = None,
) -> Tensor:
    """(N, K): g_i . (C + lambda I)^-1 g_ref, lambda = factor x trace(C) / P (or ``lam``);
    K = 1, or one column per reference example with ``per_ref``."""
    c = curvature_matrix(model, loss, names, x, y, kind)
    lam = factor * torch.trace(c) / c.shape[0] if lam is None else lam
    ref = per_example_grads(model, loss, names, x_ref, y_ref)  # (M, P)
    ref = ref if per_ref else ref.mean(0, keepdim=True)
    solved = torch.linalg.solve(c + lam * torch.eye(c.shape[0], dtype=c.dtype), ref.T)  # (P, K)
    return per_example_grads(model, loss, names, x, y) @ solved


def assert_columns_close(actual: Tensor, expected: Tensor, rtol: float = 1e-6) -> None:
    """Each reference's column of scores within ``rtol`` of the scale of its expected column."""
    actual = actual if isinstance(actual, Tensor) else torch.from_numpy(actual.copy())
    for k in range(expected.shape[1]):
        assert_rel_close(actual[:, k], expected[:, k], rtol)
