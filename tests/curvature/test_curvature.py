"""K-FAC / EK-FAC factors and preconditioned scores against their definitions, in float64.

Oracles: per-example gradients from one backward per example (``naive_grads``), layer inputs and
output gradients from plain hooks, and each preconditioner's matrix built out in full (the
Kronecker product, the rotated eigenvalues, the diagonal) and ``solve``d.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradscope.curvature.factors import DIAGONAL, FULL, FULL_ELEMENTS, KFAC, factored_convs, fit
from gradscope.curvature.fisher import SampledLoss
from gradscope.curvature.precondition import Curvature, Diagonal
from gradscope.curvature.store import Factors, metadata
from gradscope.engine import (
    Engine,
    Influence,
    Want,
    influence,
    naive_grads,
    reference_gradients,
    total,
)
from gradscope.losses import resolve_loss
from gradscope.rules import RULES, Dense, factored
from gradscope.rules.conv import conv
from gradscope.rules.factored import Factored


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Twice(nn.Module):
    """One Linear called twice: its parts merge (positions of both calls) before reducing."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.fc(torch.tanh(self.fc(x))))


class GroupedConv(nn.Module):
    """A grouped convolution at two positions (its rule keeps it factored), then a Linear."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(8, 6, 3, groups=2), nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


class WideConv(nn.Module):
    """A grouped, padded convolution at 25 positions: its rule forms per-example gradients."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(4, 6, 3, groups=2, padding=1), nn.Linear(150, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


class TiedLM(nn.Module):
    """Embedding, a Linear over positions, and an output head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(11, 6), nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.fc(self.emb(ids))))


@dataclass
class Problem:
    model: nn.Module
    inputs: tuple[Tensor, ...]
    targets: Tensor
    loss: str
    ref_inputs: tuple[Tensor, ...]
    ref_targets: Tensor


def _lm_ids(b: int, t: int) -> tuple[Tensor, Tensor]:
    ids = torch.randint(1, 11, (b, t))
    labels = ids.clone()
    labels[0, -2:] = -100  # padding at the end of one row
    ids[0, -2:] = 0
    return ids, labels


def _problem(kind: str) -> Problem:
    torch.manual_seed(0)
    if kind == "mlp":
        model, make = MLP(), lambda b: ((torch.randn(b, 5),), torch.randint(0, 3, (b,)))
        loss = "cross_entropy"
    elif kind == "twice":
        model, make = Twice(), lambda b: ((torch.randn(b, 4),), torch.randint(0, 3, (b,)))
        loss = "cross_entropy"
    elif kind == "wide_conv":
        model = WideConv()
        make = lambda b: ((torch.randn(b, 4, 5, 5),), torch.randint(0, 3, (b,)))  # noqa: E731
        loss = "cross_entropy"
    elif kind == "conv":
        model = GroupedConv()
        make = lambda b: ((torch.randn(b, 8, 3, 4),), torch.randint(0, 3, (b,)))  # noqa: E731
        loss = "cross_entropy"
    else:
        model, loss = TiedLM(), "causal_lm"

        def make(b):
            ids, labels = _lm_ids(b, 5)
            return (ids,), labels

    model = model.double().eval()
    (inputs, targets), (ref_inputs, ref_targets) = make(9), make(4)
    inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    ref_inputs = tuple(t.double() if t.is_floating_point() else t for t in ref_inputs)
    return Problem(model, inputs, targets, loss, ref_inputs, ref_targets)


KINDS = ["mlp", "conv", "wide_conv", "lm"]


def _factors(pb: Problem, loss, ekfac: bool, batches: int = 2) -> Factors:
    """Factors over the problem's examples split into ``batches`` batches."""
    engine = Engine(pb.model, loss)
    b = pb.targets.shape[0]
    step = -(-b // batches)

    def split():
        for lo in range(0, b, step):
            yield tuple(t[lo : lo + step] for t in pb.inputs), pb.targets[lo : lo + step]

    with engine, factored_convs():
        blocks, n, _ = fit(engine.contributions, split, ekfac=ekfac)
    return Factors(blocks, metadata("ekfac" if ekfac else "kfac", "empirical", n, {}))


def _captured(pb: Problem, loss) -> dict[str, tuple[Tensor, Tensor]]:
    """{module name: (a, s)} each call's input rows and output-gradient rows (B, T, D), from
    plain hooks and the summed loss: what K-FAC's definition is written in."""
    found, handles = {}, []
    for name, m in pb.model.named_modules():
        if isinstance(m, nn.Linear | nn.Conv2d):

            def hook(mod, args, out, name=name):
                x = args[0]
                out.register_hook(lambda g: found.__setitem__(name, (x.detach(), g.detach())))

            handles.append(m.register_forward_hook(hook))
    try:
        loss(pb.model(*pb.inputs), pb.targets).sum().backward()
    finally:
        for h in handles:
            h.remove()
        pb.model.zero_grad(set_to_none=True)
    return found


def _positions(m: nn.Module, x: Tensor, g: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Per group: (a, s) as (B, T, D) rows, the Conv's input unfolded by F.unfold."""
    b = x.shape[0]
    if isinstance(m, nn.Conv2d):
        patches = F.unfold(x, m.kernel_size, padding=m.padding).transpose(
            1, 2
        )  # (B, L, C*k*k), channel-major
        grads = g.flatten(2).transpose(1, 2)  # (B, L, out)
        i, o = patches.shape[-1] // m.groups, m.out_channels // m.groups
        return [
            (patches[..., k * i : (k + 1) * i], grads[..., k * o : (k + 1) * o])
            for k in range(m.groups)
        ]
    return [(x.reshape(b, -1, x.shape[-1]), g.reshape(b, -1, g.shape[-1]))]


@pytest.fixture(params=[FULL_ELEMENTS, 11, 0], ids=["small-full", "biases-full", "none-full"])
def small(request, monkeypatch) -> int:
    """The most numbers a parameter given its whole block holds: the default (every parameter
    of these problems), 11 (their biases, not their weights), 0 (none)."""
    monkeypatch.setattr("gradscope.curvature.factors.FULL_ELEMENTS", request.param)
    return request.param


def _kinds(pb: Problem, loss, small: int) -> dict[str, str]:
    """Each parameter's block: whole up to ``small`` numbers, else K-FAC for a Linear or Conv
    weight of its own, else the diagonal (a tied embedding)."""
    factored = {f"{m}.weight" for m in _captured(pb, loss) if m != "head"}
    return {
        n: FULL if p.numel() <= small else KFAC if n in factored else DIAGONAL
        for n, p in pb.model.named_parameters()
    }


@pytest.mark.parametrize("kind", KINDS)
def test_factors_are_the_definition(kind: str, small: int) -> None:
    """A = (1/N) sum_i sum_t a a^T, S = mean over counted positions of s s^T (per group), a
    small parameter's whole block (1/N) sum_i g_i g_i^T, the diagonal (1/N) sum_i g_i^2,
    EK-FAC's (1/N) sum_i (Q_S^T G_i Q_A)^2; over two batches."""
    pb = _problem(kind)
    loss = resolve_loss(pb.loss)
    factors = _factors(pb, loss, ekfac=True)
    assert {n: b.kind for n, b in factors.blocks.items()} == _kinds(pb, loss, small)
    n = pb.targets.shape[0]
    modules = dict(pb.model.named_modules())
    for name, (x, g) in _captured(pb, loss).items():
        block = factors.blocks.get(f"{name}.weight")
        if name == "head" or block.kind != KFAC:
            continue  # tied to the embedding, or whole: checked below
        for k, (a, s) in enumerate(_positions(modules[name], x, g)):
            counted = ((a != 0).any(-1) & (s != 0).any(-1)).double()  # (B, T)
            a_def = torch.einsum("bti,btj->ij", a * counted[..., None], a) / n
            s_def = torch.einsum("bti,btj->ij", s * counted[..., None], s) / counted.sum()
            torch.testing.assert_close(block.tensors["A"][k], a_def)
            torch.testing.assert_close(block.tensors["S"][k], s_def)
    names = [n_ for n_, _ in pb.model.named_parameters()]
    _, grads = naive_grads(pb.model, pb.inputs, pb.targets, loss, names)
    for name, block in factors.blocks.items():
        g = grads[name]
        if block.kind == DIAGONAL:
            torch.testing.assert_close(block.tensors["diagonal"], g.square().mean(0))
            continue
        if block.kind == FULL:
            flat = g.flatten(1)  # (N, D)
            torch.testing.assert_close(block.tensors["F"], flat.T @ flat / n)
            q, e = block.tensors["F_eigenvectors"], block.tensors["F_eigenvalues"]
            torch.testing.assert_close(q @ torch.diag(e) @ q.T, flat.T @ flat / n)
            assert block.damping["F"] == pytest.approx(0.1 * flat.square().sum() / n / g[0].numel())
            continue
        q_s, q_a = block.tensors["S_eigenvectors"], block.tensors["A_eigenvectors"]
        groups, o, i = q_s.shape[0], q_s.shape[-1], q_a.shape[-1]
        rotated = q_s.transpose(-1, -2) @ g.reshape(n, groups, o, i) @ q_a
        torch.testing.assert_close(block.tensors["lambda"], rotated.square().mean(0))


@pytest.mark.parametrize("kind", KINDS)
def test_an_example_whose_loss_is_nan_adds_nothing(kind: str, small: int) -> None:
    """The factors of 9 examples of which the 5th has a NaN loss and gradient (its loss times
    NaN) are those of the other 8: each kind of part (Outer, Dense, Rows) left out."""
    pb = _problem(kind)
    if kind == "lm":  # untied: the embedding's part is Rows
        pb.model.head.weight = nn.Parameter(pb.model.emb.weight.detach().clone())
    plain = resolve_loss(pb.loss)

    def spoilt(outputs: Tensor, targets: Tensor) -> Tensor:
        losses = plain(outputs, targets)
        if losses.shape[0] == 5:  # the first of the two batches: its last example
            return losses * torch.tensor([1.0, 1, 1, 1, float("nan")], dtype=losses.dtype)
        return losses

    keep = [i for i in range(9) if i != 4]
    clean = replace(pb, inputs=tuple(t[keep] for t in pb.inputs), targets=pb.targets[keep])
    expected = _factors(clean, plain, ekfac=True)
    engine = Engine(pb.model, spoilt)

    def split():
        yield tuple(t[:5] for t in pb.inputs), pb.targets[:5]
        yield tuple(t[5:] for t in pb.inputs), pb.targets[5:]

    with engine, factored_convs():
        blocks, n, left = fit(engine.contributions, split, ekfac=True)
    assert (n, left) == (8, 1)
    for name, block in expected.blocks.items():
        assert blocks[name].kind == block.kind
        for key, t in block.tensors.items():
            if "eigenvectors" not in key:  # their signs are eigh's to choose
                torch.testing.assert_close(blocks[name].tensors[key], t, msg=f"{name} {key}")


def _inverse(block, shape: torch.Size, ekfac: bool) -> Tensor:
    """The damped curvature of one parameter built out in full, (P, P), row-major vec."""
    t, d = block.tensors, block.damping
    if block.kind == DIAGONAL:
        return torch.diag((t["diagonal"] + d["diagonal"]).flatten())
    if block.kind == FULL:  # the block itself, damped by its mean eigenvalue's multiple
        return t["F"] + d["F"] * torch.eye(t["F"].shape[0], dtype=t["F"].dtype)
    mats = []
    for k in range(t["A"].shape[0]):
        if ekfac:
            q = torch.kron(t["S_eigenvectors"][k], t["A_eigenvectors"][k])
            mats.append(q @ torch.diag(t["lambda"][k].flatten() + d["lambda"]) @ q.T)
        else:
            eye_s, eye_a = torch.eye(t["S"].shape[-1]), torch.eye(t["A"].shape[-1])
            s = t["S"][k] + d["S"] * eye_s.double()
            mats.append(torch.kron(s, t["A"][k] + d["A"] * eye_a.double()))
    return torch.block_diag(*mats)


def _dense_scores(pb: Problem, factors: Factors, ekfac: bool, loss) -> tuple[Tensor, Tensor]:
    """(B,) g_i^T H^-1 r and (B,) g_i^T H^-1 g_i, H built out and solved."""
    names = [n for n, _ in pb.model.named_parameters()]
    _, grads = naive_grads(pb.model, pb.inputs, pb.targets, loss, names)
    _, ref_grads = naive_grads(pb.model, pb.ref_inputs, pb.ref_targets, loss, names)
    inner = self_ = 0
    for name in names:
        h = _inverse(factors.blocks[name], grads[name].shape[1:], ekfac)
        g = grads[name].flatten(1)  # (B, P)
        r = ref_grads[name].flatten(1).mean(0)  # (P,)
        inner = inner + g @ torch.linalg.solve(h, r)
        self_ = self_ + (g * torch.linalg.solve(h, g.T).T).sum(1)
    return inner, self_


@pytest.mark.parametrize("ekfac", [False, True], ids=["kfac", "ekfac"])
@pytest.mark.parametrize("kind", [*KINDS, "twice"])
def test_preconditioned_scores_are_the_dense_solve(kind: str, ekfac: bool, small: int) -> None:
    """<G_i, P R> on both engines and g_i^T P g_i from the pass equal the built-out solve."""
    pb = _problem(kind)
    loss = resolve_loss(pb.loss)
    factors = _factors(pb, loss, ekfac)
    assert {n: b.kind for n, b in factors.blocks.items()} == _kinds(pb, loss, small)
    pre = Curvature(factors)
    inner, self_ = _dense_scores(pb, factors, ekfac, loss)
    engine = Engine(pb.model, loss)
    with engine:
        refs = pre.refs(reference_gradients(engine, [(pb.ref_inputs, pb.ref_targets)]))
        for method in ("hooks", "jvp"):
            got = Influence(engine, refs, method, norms=False)(pb.inputs, pb.targets)
            torch.testing.assert_close(got.inner[:, 0], inner)
        scores = engine.scores(pb.inputs, pb.targets, Want(transform=pre.transform))
        plain = engine.norms(pb.inputs, pb.targets)
    torch.testing.assert_close(total(scores.pre_sq), self_)
    torch.testing.assert_close(total(scores.norm_sq), total(plain.norm_sq))


@pytest.mark.parametrize("kind", [*KINDS, "twice"])
def test_kfac_keeps_factored_references_factored(monkeypatch, kind: str, small: int) -> None:
    """K-FAC of a reference kept as its factors (every Outer's, whatever it costs) is factored
    still where the block is K-FAC's, ``(S+d)^-1 u`` and ``(A+d)^-1 v``, and scores as the
    built-out solve: through the factors, and through P R formed."""
    monkeypatch.setattr(influence, "cheaper", lambda *args, **kwargs: True)
    pb = _problem(kind)
    loss = resolve_loss(pb.loss)
    factors = _factors(pb, loss, ekfac=False)
    inner, _ = _dense_scores(pb, factors, False, loss)
    engine = Engine(pb.model, loss)
    with engine:
        refs = reference_gradients(engine, [(pb.ref_inputs, pb.ref_targets)], factored=True)
        kept = Curvature(factors).refs(refs)
        held = {n for n, r in refs.items() if isinstance(r, Factored)}
        kronecker = {n for n, b in factors.blocks.items() if b.kind == KFAC}
        assert {n for n, r in kept.items() if isinstance(r, Factored)} == held & kronecker
        assert held & kronecker or small == FULL_ELEMENTS  # every block whole: none K-FAC's
        for route in (True, False):  # the factors' inner products, then P R formed
            monkeypatch.setattr(factored, "cheaper", lambda *args, route=route, **kw: route)
            got = Influence(engine, kept, "hooks", norms=False)(pb.inputs, pb.targets)
            torch.testing.assert_close(got.inner[:, 0], inner)


def test_wide_conv_is_served_formed_when_scoring(monkeypatch) -> None:
    """The factors pass sees the wide conv factored; scoring gets its formed gradients, which
    the K-FAC transform whitens exactly (test_preconditioned_scores_are_the_dense_solve)."""
    monkeypatch.setattr("gradscope.curvature.factors.FULL_ELEMENTS", 0)  # not a whole block
    pb = _problem("wide_conv")
    engine = Engine(pb.model, resolve_loss(pb.loss))
    with engine:
        parts = engine.contributions(pb.inputs, pb.targets)[1]
    assert isinstance(parts["conv.weight"], Dense)  # formed: at once, or a few examples at a time
    factors = _factors(pb, resolve_loss(pb.loss), ekfac=False)
    assert factors.blocks["conv.weight"].kind == KFAC
    assert RULES[nn.Conv2d].fn is conv  # the registry as it was


def test_kfac_norms_stay_factored(monkeypatch) -> None:
    """K-FAC whitening keeps an Outer an Outer (a ghost norm, no per-example gradient)."""
    monkeypatch.setattr("gradscope.curvature.factors.FULL_ELEMENTS", 0)  # not a whole block
    pb = _problem("lm")
    loss = resolve_loss(pb.loss)
    pre = Curvature(_factors(pb, loss, ekfac=False))
    engine = Engine(pb.model, loss)
    with engine:
        parts = engine.contributions(pb.inputs, pb.targets)[1]
    assert type(pre.transform("fc.weight", parts["fc.weight"])).__name__ == "Outer"


def test_adam_self_influence() -> None:
    """g_i^T diag(1/d) g_i for Adam's d = sqrt(v_hat) + eps, tied weights included."""
    pb = _problem("lm")
    loss = resolve_loss(pb.loss)
    names = [n for n, _ in pb.model.named_parameters()]
    _, grads = naive_grads(pb.model, pb.inputs, pb.targets, loss, names)
    d = {n: torch.rand_like(p) + 0.1 for n, p in pb.model.named_parameters()}
    pre = Diagonal(d, "adam")
    engine = Engine(pb.model, loss)
    with engine:
        scores = engine.scores(pb.inputs, pb.targets, Want(transform=pre.transform))
    expected = sum((grads[n].square() / d[n]).flatten(1).sum(1) for n in names)
    torch.testing.assert_close(total(scores.pre_sq), expected)


@pytest.mark.parametrize("kind", ["mlp", "lm"])
def test_true_fisher_is_the_empirical_one_on_sampled_targets(kind: str) -> None:
    """The true Fisher's factors equal the empirical Fisher's on the labels the sampler drew,
    each example's mean over its T counted positions scaled by sqrt(T) (the LM's rows)."""
    pb = _problem(kind)
    loss = resolve_loss(pb.loss)
    sampled = SampledLoss(pb.loss, loss, {}, -1, seed=3)
    with torch.no_grad():
        drawn = sampled.sample(pb.model(*pb.inputs), pb.targets)
    if kind == "lm":  # padding and the first position keep their labels
        assert (drawn[pb.targets == -100] == -100).all()
        assert torch.equal(drawn[:, 0], pb.targets[:, 0])
    true = _factors(pb, sampled, ekfac=False, batches=1)
    pb.targets = drawn
    counted = (drawn[:, 1:] != -100).sum(1) if kind == "lm" else torch.ones(len(drawn))

    def scaled(outputs, targets):
        return loss(outputs, targets) * counted.to(outputs.dtype).sqrt()

    empirical = _factors(pb, scaled, ekfac=False, batches=1)
    for name, block in true.blocks.items():
        for key, t in block.tensors.items():
            torch.testing.assert_close(t, empirical.blocks[name].tensors[key])


def test_sampled_classes_follow_the_model() -> None:
    logits = torch.tensor([[2.0, 0.0, -1.0]]).expand(20000, 3)
    drawn = SampledLoss("cross_entropy", None, {}, -1, seed=0).sample(logits, torch.zeros(20000))
    freq = torch.bincount(drawn, minlength=3).double() / 20000
    torch.testing.assert_close(freq, logits[0].double().softmax(0), atol=0.015, rtol=0)
