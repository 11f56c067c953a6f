"""Routed regions whose rows' examples the ops settle by position alone (``replay/forms.py``):
Hugging Face Mixtral's grouped experts sort the tokens by expert, gather them by the sort's
permutation, put them back by its inverse and sum each token's top 2. Its replay raises no
flag, so it reads nothing on the host that a plain step does not, and stays exact where an
expert gets no token, on a batch of 1 and on padded batches: against the float64 loop over a
copy whose experts run transformers' eager loop (``grouped_mm`` has no float64 kernel), to
float32's precision. The forms themselves are checked against the rows they describe,
computed on tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from oracle import assert_rel_close
from syncs import counted
from torch import Tensor

from gradscope.engine import Engine, Want, naive_grads, total
from gradscope.engine.replay.forms import INV, PICK, REP, merged, normal, picked, split
from gradscope.engine.replay.rowflow import RowFlow
from gradscope.engine.replay.rowops import rows_after
from gradscope.losses import resolve_loss

transformers = pytest.importorskip("transformers")
import families  # noqa: E402 - after the skip: its builders import transformers

VOCAB, T, EXPERTS = 64, 6, 8
LOSS = resolve_loss("cross_entropy")


def _model():
    torch.manual_seed(0)
    model = families.hf_mixtral(vocab=VOCAB, d=16, layers=2, heads=2, experts=EXPERTS, seq=T)
    return model.eval()


def _oracle(model):
    """A float64 copy whose experts run the eager loop, one ``F.linear`` per expert hit."""
    double = copy.deepcopy(model).double()
    double.model.config._experts_implementation = "eager"
    return double


def _batch(seed: int, n: int, padded: bool = False) -> tuple[tuple[Tensor, ...], Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, T), generator=g)
    targets = ids[:, 1:].contiguous()
    if not padded:
        return (ids,), targets
    mask = families.padding_mask(n, T, g)
    return (ids * mask, mask), targets.masked_fill(mask[:, 1:] == 0, -100)


def _check(oracle, engine: Engine, batch, refs: dict[str, Tensor]) -> None:
    inputs, targets = batch
    scores = engine.scores(inputs, targets, Want(norms=True, refs=refs))
    names = [p.name for p in engine.plan.included]
    _, grads = naive_grads(oracle, inputs, targets, LOSS, names)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0)
    assert_rel_close(total(scores.norm_sq), norms, 1e-5)
    for name, ref in refs.items():  # float32's error, relative to |g| |ref| (terms cancel)
        g, r = grads[name].flatten(1), ref.flatten().double()
        err = (scores.inner[name][:, 0].double() - g @ r).abs() / (g.norm(dim=1) * r.norm())
        assert bool((err < 1e-5).all()), (name, err)


def _routed(model, inputs: tuple[Tensor, ...]) -> Tensor:
    """How many of the batch's token-expert pairs the first layer routes to each expert."""
    seen = []
    experts = model.model.model.layers[0].mlp.experts
    handle = experts.register_forward_pre_hook(lambda m, args: seen.append(args[1]))
    with torch.no_grad():
        model(*inputs)
    handle.remove()
    return torch.bincount(seen[0].flatten(), minlength=EXPERTS)


@pytest.mark.parametrize(("n", "padded"), [(3, False), (1, False), (3, True)])
def test_grouped_experts_replay_exact(n: int, padded: bool):
    model = _model()
    oracle = _oracle(model)
    torch.manual_seed(1)
    refs = {name: torch.randn(1, *p.shape) for name, p in model.named_parameters()}
    with Engine(model, LOSS) as engine:
        for seed in range(3):
            _check(oracle, engine, _batch(seed, n, padded), refs)
        findings = engine.record.at(*_batch(0, n, padded))
        assert findings.replays == 2, findings.why
        (program,) = findings.programs
        routed = sum(getattr(s, "routed", False) for s in program.steps)
        assert routed == 2 or n == 1  # one a layer (where rows of one example meet, fewer)
    if n == 1:  # 12 token-expert pairs for 8 experts: a replayed batch left one with none
        assert any(bool((_routed(model, _batch(s, n)[0]) == 0).any()) for s in (1, 2))


def test_a_replayed_pass_syncs_no_more_than_a_plain_step():
    model = _model()
    params = [p for p in model.parameters() if p.requires_grad]
    with Engine(model, LOSS) as engine:
        for seed in range(2):
            engine.norms(*_batch(seed, 3))
        inputs, targets = _batch(2, 3)
        with counted() as ours:
            engine.norms(inputs, targets)
        assert engine.record.at(inputs, targets).replays == 2  # the counted pass replayed
    with counted() as plain:
        torch.autograd.grad(LOSS(model(*inputs), targets).sum(), params)
    assert sorted(ours) == sorted(plain), (ours, plain)


def _rows(form: tuple, n: int, batch: int, perms: dict[int, Tensor]) -> Tensor:
    """The rows a form describes, by applying its maps to each position: the oracle."""
    m, maps = form
    i = torch.arange(n)
    for kind, k in maps:
        if kind == REP:
            i = i // k
        elif kind == PICK:
            i = perms[k][i]
        else:
            i = torch.argsort(perms[k])[i]
    return i // m % batch


def test_forms_describe_the_rows_ops_make():
    """Tokens of 3 examples (5 each, top 2): each form against the same rows made by the ops a
    grouped MoE runs, for permutations of several seeds."""
    batch, tokens, k = 3, 5, 2
    n = batch * tokens
    for seed in range(5):
        perm = torch.randperm(n * k, generator=torch.Generator().manual_seed(seed))
        perms = {id(perm): perm}
        p = id(perm)
        tokens_rows = torch.arange(n) // tokens % batch  # the examples of the (B*T) tokens
        lane = (tokens, ())
        gathered = picked(((PICK, p), (REP, k)), lane)  # x[perm // k]
        assert torch.equal(_rows(gathered, n * k, batch, perms), tokens_rows[perm // k])
        weights = picked(((PICK, p),), split(lane, k))  # w.reshape(-1)[perm]
        assert weights == gathered
        back = picked(((INV, p),), gathered)  # out[inv]: each token's k rows together again
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(n * k)
        assert torch.equal(_rows(back, n * k, batch, perms), tokens_rows[perm // k][inv])
        assert back == normal(tokens * k, ())
        summed = merged(back, k)  # .view(n, k, -1).sum(1)
        assert summed == lane and torch.equal(_rows(summed, n, batch, perms), tokens_rows)
        assert merged(merged(back, k), tokens) == (1, ())  # .reshape(B, T, H): one row each
        assert merged(gathered, k) is None  # sorted rows merged: the values decide


def test_a_permutation_written_in_place_settles_nothing():
    """The forms that name a permutation hold for the values it had: once it is written in
    place (or viewed, which a later write could go through), none of them is used again, and
    the flags that compare rows are raised as the values say."""
    flow = RowFlow(2)
    x = torch.randn(4, 3)
    rows = flow.lane(x, (0, 2))  # tokens 0, 1 of example 0, then example 1's
    flow.keep(x, rows)
    experts = torch.tensor([3, 0, 2, 1])
    flow.keep(experts, rows)
    expert, perm = torch.sort(experts)
    flow.follow("sort", (experts,), {}, (expert, perm))
    gathered = rows_after(flow, "__getitem__", (x, perm), {}, x[perm])
    assert flow.form(gathered) == (2, ((PICK, id(perm)),))
    assert flow.combine([gathered, rows_after(flow, "index_select", (x, 0, perm), {}, x)]) is (
        gathered
    )  # the same form: no flag
    assert not flow.wrong
    perm.add_(0)
    flow.indexing("add_", (perm, 0), {}, perm)
    assert flow.maps(perm) is None and flow.form(gathered) is None
    again = rows_after(flow, "__getitem__", (x, perm), {}, x[perm])
    flow.combine([gathered, again])
    assert flow.wrong  # compared by values now
