"""RNN, GRU and LSTM on packed sequences (``pack_padded_sequence``, sorted or not, batch-first
or not, an initial state given), through ``gradscope.per_example_norms`` and one Engine over
several batches, against the float64 per-example loop: each parameter served by the
``recurrent`` rule, its rows told apart by the packed sequence's sorting."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_rel_close, findings_by_shape, reference_norms
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import gradscope
from gradscope.engine import Engine, total
from gradscope.engine.steps import RegionCall
from gradscope.errors import ModelError
from gradscope.losses import resolve_loss

T, IN, H = 4, 3, 5


class Packed(nn.Module):
    """The RNN over each example's first ``lengths[i]`` steps, padded back (``state``: from
    an initial state made of each example's first input; ``last``: the final hidden state
    instead, which no rule serves)."""

    def __init__(self, rnn: nn.RNNBase, sort: bool = False, state: bool = False, last=False):
        super().__init__()
        self.rnn, self.sort, self.state, self.last = rnn, sort, state, last
        self.states = rnn.num_layers * (2 if rnn.bidirectional else 1)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        first, b = self.rnn.batch_first, x.shape[0]
        hx = None
        if self.state:  # (layers * directions, B, H), example order
            hx = torch.tanh(x[:, 0, :1]).T.unsqueeze(-1).expand(self.states, b, H).contiguous()
            hx = (hx, -hx) if isinstance(self.rnn, nn.LSTM) else hx
        if not first:
            x = x.transpose(0, 1)  # (T, B, IN)
        packed = pack_padded_sequence(x, lengths, first, enforce_sorted=self.sort)
        out, state = self.rnn(packed, hx)
        if self.last:
            return (state[0] if isinstance(state, tuple) else state)[-1]  # (B, H)
        out, _ = pad_packed_sequence(out, first, total_length=T)
        return out if first else out.transpose(0, 1)  # (B, T, D*H), zeros past each length


def lengths_of(kind: str, b: int, g: torch.Generator) -> Tensor:
    if kind == "equal":
        return torch.full((b,), T)
    lengths = torch.randint(1, T + 1, (b,), generator=g)
    lengths[-1] = 1  # a sequence of one step
    if kind == "sorted":
        lengths = lengths.sort(descending=True).values
    return lengths


def check(model: nn.Module, kind: str, b: int, n: int = 3) -> Engine:
    """n batches by fresh calls and by one Engine, against the loop; the Engine."""
    g = torch.Generator().manual_seed(b)
    data = []
    for _ in range(n):
        x = torch.randn(b, T, IN, generator=g, dtype=torch.float64)
        inputs = (x, lengths_of(kind, b, g))
        with torch.no_grad():
            data.append((inputs, torch.randn_like(model(*inputs))))
    expected = [reference_norms(model, x, y)[1] for x, y in data]
    for (x, y), norms in zip(data, expected, strict=True):
        assert_rel_close(gradscope.per_example_norms(model, x, y, "mse"), norms, 1e-9)
    with Engine(model, resolve_loss("mse")) as engine:
        for (x, y), norms in zip(data, expected, strict=True):
            assert_rel_close(total(engine.norms(x, y).norm_sq).sqrt(), norms, 1e-9)
    return engine


RNNS = {
    "rnn-relu": lambda: nn.RNN(IN, H, nonlinearity="relu", batch_first=True),
    "gru": lambda: nn.GRU(IN, H, batch_first=True),
    "lstm-seq-first": lambda: nn.LSTM(IN, H),
    "rnn-2-layers-bidirectional": lambda: nn.RNN(IN, H, 2, bidirectional=True, batch_first=True),
    "gru-2-layers-bidirectional": lambda: nn.GRU(IN, H, 2, bidirectional=True),
    "lstm-2-layers-bidirectional": lambda: nn.LSTM(IN, H, 2, bidirectional=True, batch_first=True),
}


@pytest.mark.parametrize(("kind", "b"), [("ragged", 4), ("equal", 3), ("ragged", 1)])
@pytest.mark.parametrize("name", list(RNNS))
def test_packed_sequences_match_the_loop(name: str, kind: str, b: int) -> None:
    torch.manual_seed(0)
    engine = check(Packed(RNNS[name]()).double(), kind, b)
    assert {p.rule for p in engine.plan.params} == {"recurrent"}


@pytest.mark.parametrize("name", ["gru", "lstm-2-layers-bidirectional"])
def test_sorted_packs_and_initial_states_match_the_loop(name: str) -> None:
    """``enforce_sorted`` (no sorting's indices: rows in example order), and each example's
    own initial state, given in example order and sorted inside the RNN."""
    torch.manual_seed(0)
    for sort, kind in ((True, "sorted"), (False, "ragged")):
        engine = check(Packed(RNNS[name](), sort=sort, state=True).double(), kind, 4)
        assert {p.rule for p in engine.plan.params} == {"recurrent"}


class Learned(Packed):
    """An initial state made from a parameter alone, the same for every example."""

    def __init__(self, rnn: nn.RNNBase):
        super().__init__(rnn)
        self.h0 = nn.Parameter(torch.randn(self.states, 1, H))

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        hx = self.h0.expand(-1, x.shape[0], -1).contiguous()  # (layers * directions, B, H)
        packed = pack_padded_sequence(x, lengths, True, enforce_sorted=False)
        out, _ = pad_packed_sequence(self.rnn(packed, hx)[0], True, total_length=T)
        return out


def test_a_learned_initial_state_leaves_the_rnn_to_its_rule() -> None:
    """The call is the RNN's (its packed sequence among its tensors), not one on tensors of
    parameters alone; the state's parameter, which no rule serves, goes to the fallback."""
    torch.manual_seed(0)
    engine = check(Learned(RNNS["gru"]()).double(), "ragged", 4)
    rules = {p.name: p.rule for p in engine.plan.params}
    assert rules.pop("h0").startswith("fallback") and set(rules.values()) == {"recurrent"}


def test_final_state_in_the_loss_goes_to_the_fallback() -> None:
    torch.manual_seed(0)
    engine = check(Packed(RNNS["gru"](), last=True).double(), "ragged", 4)
    assert all(p.is_fallback and "second output" in p.note for p in engine.plan.params)


def mixed(d: int):
    """Batch ``seed`` of ``b`` examples and (b, T, d) targets: every third one's lengths all
    equal, the others ragged with a sequence of one step."""

    def batch(seed: int, b: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(b, T, IN, generator=g, dtype=torch.float64)
        lengths = lengths_of("equal" if seed % 3 == 1 else "ragged", b, g)
        return (x, lengths), torch.randn(b, T, d, generator=g, dtype=torch.float64)

    return batch


@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("name", ["gru", "lstm-seq-first", "lstm-2-layers-bidirectional"])
def test_packed_batches_of_other_lengths_replay_exact(name: str, state: bool) -> None:
    """The model's own call, whose top-level sort picks the packed rows, is the region: every
    batch after a shape's first replays it, whatever its lengths (all equal, one of one step,
    a batch of one), its output's padding elsewhere than the analysed batch's; each exact.
    Its rows followed through the sort, the pack, the RNN (its initial states, each example's,
    met in their slots) and the padding (a routed region, open: the packed kernels make as many
    autograd nodes as the lengths say), not traced."""
    torch.manual_seed(0)
    rnn = RNNS[name]()
    model, batch = Packed(rnn, state=state).double(), mixed(H * (2 if rnn.bidirectional else 1))
    shapes = [(4,)] * 4 + [(1,)] * 3
    with Engine(model, resolve_loss("mse")) as engine:
        for seed, (b,) in enumerate(shapes):
            inputs, y = batch(seed, b)
            got = total(engine.norms(inputs, y).norm_sq).sqrt()
            assert_rel_close(got, reference_norms(model, inputs, y)[1], 1e-9)
    for findings in findings_by_shape(engine, batch, shapes).values():
        (program,) = findings.programs
        regions = [s for s in program.steps if isinstance(s, RegionCall)]
        assert [(r.routed, r.open) for r in regions] == [(True, True)]


class Shuffled(Packed):
    """Rows sorted by their first value before the pack, their lengths not: a batch whose
    first values are already in order packs each example's own steps, any other mixes them."""

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        return super().forward(x[x[:, 0, 0].argsort()], lengths)


def in_order_then_reversed(model: nn.Module) -> tuple:
    """Two batches whose first values come in order, each replayed exact, then one in reverse
    order, refused as mixing the examples; (its findings, its inputs and targets)."""
    g = torch.Generator().manual_seed(0)
    with Engine(model, resolve_loss("mse")) as engine:
        for k in range(3):
            x = torch.randn(4, T, IN, generator=g, dtype=torch.float64)
            x = x[x[:, 0, 0].argsort()]
            inputs = (x if k < 2 else x.flip(0), torch.tensor([4, 2, 3, 1]))
            y = torch.randn(4, T, H, generator=g, dtype=torch.float64)
            if k == 2:
                with pytest.raises(ModelError, match="mixes the examples"):
                    engine.norms(inputs, y)
                break
            got = total(engine.norms(inputs, y).norm_sq).sqrt()
            assert_rel_close(got, reference_norms(model, inputs, y)[1], 1e-9)
        return engine.record.at(inputs, y), inputs, y


def test_rows_the_values_mix_in_a_later_batch_are_not_replayed() -> None:
    """The analysed batch's rows in order, and a later one's, replayed exact; a batch whose
    values put example j's steps in example i's slot meets its lengths' rows there: flagged,
    not replayed, and the analysis finds the model mixing the examples."""
    torch.manual_seed(0)
    findings, _, _ = in_order_then_reversed(Shuffled(RNNS["gru"]()).double())
    assert findings.replays == 1 and "rows that the batch's values" in findings.why


class Relengthed(Packed):
    """Each example packed with the length of the row its first value sorts there: its own
    where the batch comes in that order, another example's in any other."""

    def __init__(self, rnn: nn.RNNBase, dtype: torch.dtype):
        super().__init__(rnn)
        self.dtype = dtype

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        return super().forward(x, lengths[x[:, 0, 0].argsort()].to(self.dtype))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_lengths_of_other_examples_are_refused(dtype: torch.dtype) -> None:
    """A batch in order replays exact; one whose values give example i another's length is
    flagged, and its analysis finds the pack's slots met by another example's length: refused
    as mixing the examples (on main the analysis took each slot's rows alone: 0.65 off)."""
    torch.manual_seed(0)
    model = Relengthed(RNNS["gru"](), dtype).double()
    _, inputs, y = in_order_then_reversed(model)
    with pytest.raises(ModelError, match="mixes the examples"):
        gradscope.per_example_norms(model, inputs, y, "mse")  # analysed afresh
