"""The watch: each step's per-example numbers against a float64 per-example loop, and the
training it serves against the same training without it."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from oracle import redrawn_norms
from tied_seq import TiedSeq
from torch import nn

from gradscope.errors import ConfigError, ModelError
from gradscope.training.watch import Watch


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _data(n: int = 10):
    torch.manual_seed(1)
    return torch.randn(n, 5, dtype=torch.float64), torch.randint(0, 3, (n,))


def _oracle(model: nn.Module, x, y) -> dict[str, np.ndarray]:
    """Each example alone: its loss, gradient norm, margin and correctness."""
    rows = {"loss": [], "grad_norm": [], "margin": [], "correct": []}
    for i in range(len(y)):
        out = model(x[i : i + 1])[0]
        loss = nn.functional.cross_entropy(out, y[i])
        grads = torch.autograd.grad(loss, list(model.parameters()))
        other = torch.cat([out[: y[i]], out[y[i] + 1 :]]).max()
        rows["loss"].append(loss.item())
        rows["grad_norm"].append(torch.stack([g.square().sum() for g in grads]).sum().sqrt().item())
        rows["margin"].append((out[y[i]] - other).item())
        rows["correct"].append(float(out.argmax() == y[i]))
    return {k: np.array(v) for k, v in rows.items()}


def _train(model, x, y, batch, step):
    """Two epochs of SGD with momentum in batches of ``batch``; ``step`` does the forward and
    backward of one batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=0.01)
    for epoch in range(2):
        for start in range(0, len(y), batch):
            rows = torch.arange(start, min(start + batch, len(y)))
            optimizer.zero_grad()
            step(rows, epoch)
            optimizer.step()


@pytest.mark.parametrize("batch", [4, 3])
def test_numbers_equal_the_loop_and_the_weights_the_plain_run(tmp_path, batch):
    x, y = _data()
    watched, plain = _model(), _model()
    expected = []

    def plain_step(rows, epoch):
        expected.append(_oracle(plain, x[rows], y[rows]))
        nn.functional.cross_entropy(plain(x[rows]), y[rows], reduction="none").mean().backward()

    _train(plain, x, y, batch, plain_step)
    with Watch(watched, tmp_path / "w.parquet") as watch:
        _train(watched, x, y, batch, lambda r, e: watch.step(x[r], y[r], r, epoch=e).backward())
    for p, q in zip(watched.parameters(), plain.parameters(), strict=True):
        if batch == 4:  # a power of two: the mean's gradient bit for bit
            assert torch.equal(p, q)
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    table = pq.read_table(tmp_path / "w.parquet").to_pydict()
    steps = len(expected)
    assert sorted(set(table["step"])) == list(range(steps))
    assert table["example_id"] == [i for _ in range(2) for i in range(10)]
    assert table["epoch"] == [0] * 10 + [1] * 10
    for name in ("loss", "grad_norm", "margin", "correct"):
        want = np.concatenate([e[name] for e in expected])
        np.testing.assert_allclose(table[name], want, rtol=1e-10, atol=1e-12)


def test_the_model_is_left_as_it_was(tmp_path):
    model = _model().train()
    model[0].weight.requires_grad_(False)
    hooks = model[0]._forward_hooks.copy()
    x, y = _data(4)
    with Watch(model, tmp_path / "w.parquet") as watch:
        assert model.training  # trains in its own mode
        watch.step(x, y, torch.arange(4)).backward()
        assert model[0].weight.grad is None  # frozen: no gradient
    assert model.training and not model[0].weight.requires_grad
    assert model[0]._forward_hooks == hooks and not model[2]._forward_hooks
    assert not any(m._backward_hooks or m._forward_pre_hooks for m in model.modules())


def test_a_watch_never_entered_refuses_its_steps(tmp_path):
    """Without ``with``, the steps trained and the watch wrote nothing, without a word."""
    model, (x, y) = _model(), _data(4)
    watch = Watch(model, tmp_path / "w.parquet")
    with pytest.raises(ConfigError, match="the watch is not entered, so it writes no file"):
        watch.step(x, y, torch.arange(4))
    with watch:
        watch.step(x, y, torch.arange(4)).backward()
    with pytest.raises(ConfigError, match="the watch is not entered"):  # after its exit too
        watch.step(x, y, torch.arange(4))
    assert len(pq.read_table(tmp_path / "w.parquet")) == 4


def test_a_file_of_the_users_at_the_watch_files_path_is_not_replaced(tmp_path):
    """The watch moved its file over notes.txt, or a validate table, at its end."""
    for name, said in (("notes.txt", "written as Parquet, not .txt"),
                       ("notes.parquet", "not a gradscope watch file; .* another out=")):  # fmt: skip
        (tmp_path / name).write_text("mine")
        with pytest.raises(ConfigError, match=said):
            Watch(_model(), tmp_path / name)
        assert (tmp_path / name).read_text() == "mine"


def test_a_steps_errors_name_its_arguments(tmp_path):
    """A step's inputs and targets of other counts were named as the config's data.inputs."""
    with Watch(_model(), tmp_path / "w.parquet") as watch:
        x = torch.randn(5, 5, dtype=torch.float64)
        with pytest.raises(ModelError, match=r"targets hold 4 examples.*\(inputs=, targets=\)$"):
            watch.step(x, torch.zeros(4, dtype=torch.long), torch.arange(4))
        watch.discard()


def test_dropout_is_watched_under_the_masks_its_step_drew(tmp_path):
    """Every forward of a step draws the masks its first drew: each example's norm is of its
    loss under the batch's masks, ``.grad`` is the plain step's, and the generator is left
    where one forward leaves it; the second step is the analysed program's replay."""
    torch.manual_seed(0)
    watched = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.Linear(8, 3)).double().train()
    plain = copy.deepcopy(watched)
    x, y = _data(6)
    torch.manual_seed(3)
    with Watch(watched, tmp_path / "w.parquet") as watch:
        for _ in range(2):
            watch.step(x, y, torch.arange(6)).backward()
    after = torch.get_rng_state()
    norms = redrawn_norms(  # example i's own loss, the batch's masks redrawn
        plain, 6, [(lambda i: nn.functional.cross_entropy(plain(x)[i], y[i]),
                    lambda: nn.functional.cross_entropy(plain(x), y))] * 2,
    )  # fmt: skip
    assert torch.equal(torch.get_rng_state(), after)
    for p, q in zip(watched.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    table = pq.read_table(tmp_path / "w.parquet").to_pydict()
    np.testing.assert_allclose(table["grad_norm"], norms, rtol=1e-10, atol=1e-12)


class _Noisy(nn.Module):
    """Noise from a generator of its own, which the watch cannot draw again (numpy's and
    Python's global ones it can: ``test_watch_host_draws.py``)."""

    def __init__(self):
        super().__init__()
        self.fc, self.noise = nn.Linear(5, 3).double(), np.random.default_rng(0)

    def forward(self, x):
        return self.fc(x + torch.as_tensor(self.noise.random(x.shape)))


def test_randomness_outside_the_global_generators_is_refused(tmp_path):
    x, y = _data(4)
    with (
        Watch(_Noisy(), tmp_path / "w.parquet") as watch,
        pytest.raises(ModelError, match="second"),
    ):
        watch.step(x, y, torch.arange(4))


class _LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.head = nn.Embedding(7, 6), nn.Linear(6, 7)

    def forward(self, ids):
        return self.head(torch.tanh(self.tok(ids)))  # (B, T, V)


def test_tokens_mean_serves_the_token_mean_and_each_examples_own_mean(tmp_path):
    torch.manual_seed(2)
    watched = _LM().double()
    plain = copy.deepcopy(watched)
    ids = torch.randint(0, 7, (3, 5))
    ids[1, 2:] = -100  # fewer counted tokens in one row
    inputs = ids.clamp_min(0)
    with Watch(watched, tmp_path / "w.parquet", "causal_lm", reduction="tokens") as watch:
        watch.step(inputs, ids, torch.tensor([5, 6, 7])).backward()
    logits = plain(inputs)
    nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    for p, q in zip(watched.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    table = pq.read_table(tmp_path / "w.parquet").to_pydict()
    for i in range(3):
        loss = nn.functional.cross_entropy(plain(inputs[i : i + 1])[0, :-1], ids[i, 1:])
        grads = torch.autograd.grad(loss, list(plain.parameters()))
        norm = torch.stack([g.square().sum() for g in grads]).sum().sqrt().item()
        assert table["loss"][i] == pytest.approx(loss.item(), rel=1e-12)
        assert table["grad_norm"][i] == pytest.approx(norm, rel=1e-10)
        assert table["prob"][i] == pytest.approx(np.exp(-loss.item()), rel=1e-12)


@pytest.mark.parametrize("loss", ["cross_entropy", "causal_lm"])
def test_a_row_of_no_counted_target_has_no_loss(tmp_path, loss):
    """Every target ignore_index: a mean over nothing is no loss of 0 (it was written 0 and
    finite, and led ``summary --by loss:low`` as the best-fitted); its gradient is 0."""
    if loss == "causal_lm":
        model, inputs = _LM().double(), torch.randint(0, 7, (3, 5))
        targets = inputs.clone()
        targets[1, 1:] = -100
    else:
        model, (inputs, targets) = _model(), _data(3)
        targets[1] = -100
    with Watch(model, tmp_path / "w.parquet", loss) as watch:
        watch.step(inputs, targets, torch.arange(3)).backward()
    table = pq.read_table(tmp_path / "w.parquet").to_pydict()
    assert np.isnan(table["loss"][1]) and table["grad_norm"][1] == 0
    assert table["finite"] == [True, False, True] and np.isfinite(table["loss"][::2]).all()


def test_batch_gradients_summed_from_the_formed_examples_are_autograds(tmp_path):
    torch.manual_seed(3)
    watched = TiedSeq().double().train()
    plain = copy.deepcopy(watched)
    ids = torch.randint(0, 11, (3, 3, 6))  # 3 steps of 3 sequences of 6 tokens
    opts = [torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9) for m in (watched, plain)]
    expected = []
    with Watch(watched, tmp_path / "w.parquet", "causal_lm") as watch:
        for step, batch in enumerate(ids):
            for opt in opts:
                opt.zero_grad()
            for i in range(3):  # each example alone: its gradient's norm
                logits = plain(batch[i : i + 1])[0, :-1]
                loss = nn.functional.cross_entropy(logits, batch[i, 1:])
                grads = torch.autograd.grad(loss, list(plain.parameters()))
                expected.append(torch.stack([g.square().sum() for g in grads]).sum().sqrt())
            logits = plain(batch)[:, :-1]
            nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
            watch.step(batch, batch, torch.arange(3) + 3 * step).backward()
            for p, q in zip(watched.parameters(), plain.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
            for opt in opts:
                opt.step()
        findings = watch.engine.record.at((ids[0],), ids[0])
    # formed on the first step, the two replayed steps took these batch gradients from the sums
    assert findings.replays == 2
    assert {"tok.weight", "attn.in_proj_weight", "ff.weight", "ff.bias"} <= findings.formed
    assert len(findings.programs[-1].trained) == 1  # their requests read once, kept after
    for p, q in zip(watched.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)  # to float rounding
    table = pq.read_table(tmp_path / "w.parquet").to_pydict()
    np.testing.assert_allclose(table["grad_norm"], torch.stack(expected), rtol=1e-10)


def test_a_rule_failing_on_a_summed_step_gives_the_fallbacks_sum(tmp_path):
    torch.manual_seed(4)
    watched = nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 11)).double()
    plain = copy.deepcopy(watched)
    ids = torch.randint(0, 11, (3, 2, 6))
    with Watch(watched, tmp_path / "w.parquet", "causal_lm") as watch:
        for step, batch in enumerate(ids):
            if step == 2:  # formed on the steps before, summed on this: its rule fails here
                rules, linear = watch.engine.plan.rules, id(watched[1])
                rules[linear] = dataclasses.replace(rules[linear], fn=_fails)
            watched.zero_grad()
            plain.zero_grad()
            watch.step(batch, batch, torch.arange(2)).backward()
            logits = plain(batch)[:, :-1]
            per_example = nn.functional.cross_entropy(
                logits.transpose(1, 2), batch[:, 1:], reduction="none"
            )
            per_example.mean(1).mean().backward()
            for p, q in zip(watched.parameters(), plain.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    assert watch.engine.plan.find("1.weight").is_fallback


def _fails(*args, **kwargs):
    raise RuntimeError("a rule that fails")


class _DroppedGain(nn.Module):
    """Dropout, and a per-feature gain read through ``torch.mm``, which no rule serves: the
    exact fallback runs each example alone."""

    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(5, 3).double(), nn.Dropout(0.5)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))

    def forward(self, x):
        return torch.mm(self.drop(self.fc(x)), torch.diag(self.gain))


def test_dropout_with_a_parameter_on_the_fallback_is_one_line(tmp_path):
    x, y = _data(4)
    with (
        Watch(_DroppedGain().train(), tmp_path / "w.parquet") as watch,
        pytest.raises(ModelError, match="cannot draw the masks the batch drew") as raised,
    ):
        watch.step(x, y, torch.arange(4))
    assert "\n" not in str(raised.value)


class _Unmixed(nn.Module):
    """A batch statistic taken times zero: the trace sees the losses mix the examples, the
    check finds they do not, and every parameter goes to the exact fallback."""

    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, x):
        out = self.net(x)
        return out + 0 * out.mean(0)


def test_every_parameter_on_the_fallback_trains_step_after_step(tmp_path):
    """A later step's analysis keeps the graph its batch gradient needs, where every
    parameter is on the fallback (it kept none, and failed at the second step); the numbers
    and weights are the plain run's."""
    x, y = _data()
    watched, plain = _Unmixed(), _model()
    expected = []

    def plain_step(rows, epoch):
        expected.append(_oracle(plain, x[rows], y[rows]))
        nn.functional.cross_entropy(plain(x[rows]), y[rows]).backward()

    _train(plain, x, y, 4, plain_step)
    with Watch(watched, tmp_path / "w.parquet") as watch:
        _train(watched, x, y, 4, lambda r, e: watch.step(x[r], y[r], r, epoch=e).backward())
        assert all(p.is_fallback for p in watch.engine.plan.included)
    for p, q in zip(watched.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    table = pq.read_table(tmp_path / "w.parquet").to_pydict()
    for name in ("loss", "grad_norm"):
        want = np.concatenate([e[name] for e in expected])
        np.testing.assert_allclose(table[name], want, rtol=1e-10, atol=1e-12)


def test_a_hook_on_a_parameters_gradient_is_one_line(tmp_path):
    """A hook on a gradient runs in the step's backward and again as ``.grad`` receives it:
    a scale of 0.5 gave ``.grad`` 0.25 of the gradient, without a word."""
    model = _model()
    model[2].bias.register_hook(lambda g: g * 0.5)
    with pytest.raises(ConfigError, match="parameter 2.bias has a hook on its gradient") as e:
        Watch(model, tmp_path / "w.parquet")
    assert "\n" not in str(e.value) and not (tmp_path / "w.parquet").exists()
