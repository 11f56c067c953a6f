"""The owners of a packed sequence's ops (``nn.utils.rnn``): packing and padding move rows, the
same op run on the owners; a recurrent op on a packed sequence (``_VF.lstm(data, batch_sizes,
...)``) keeps each row's slot, row j of every step, and a slot's rows share their owners."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...rules.recurrent import slots
from ..tensors import tensors_in
from .owners import NONE, combine, reduce, segment_combine, shrink

if TYPE_CHECKING:
    from .trace import RowTrace


def _none(t: Tensor) -> Tensor:
    return torch.full((1,) * t.dim(), NONE, dtype=torch.long, device=t.device)


def _pack(trace: RowTrace, x: Tensor, lengths: Tensor, batch_first: bool) -> tuple:
    """_pack_padded_sequence(input, lengths, batch_first): rows that the lengths pick, each
    slot's met by its length's (the length of another example's row mixes them)."""
    if trace._of_batch(lengths):
        trace.picked("_pack_padded_sequence")
    along = [1] * x.dim()
    along[0 if batch_first else 1] = -1
    length = trace.owner(lengths).reshape(-1).to(x.device).view(along)  # each slot's length's
    owners = combine(trace.owner(x), length).expand(x.shape).contiguous()
    data, sizes = torch._VF._pack_padded_sequence(owners, lengths, batch_first)
    return shrink(data), _none(sizes)


def _pad(trace: RowTrace, data: Tensor, sizes: Tensor, batch_first: bool, _, length) -> tuple:
    """_pad_packed_sequence(data, batch_sizes, batch_first, value, length): the padding is no
    example's."""
    owners = trace.owner(data).expand(data.shape).contiguous()
    padded, lengths = torch._VF._pad_packed_sequence(owners, sizes, batch_first, NONE, length)
    return shrink(padded), _none(lengths)


def recurrent(trace: RowTrace, data: Tensor, sizes: Tensor, hx: object, *args) -> tuple:
    """_VF.lstm / gru / rnn_tanh / rnn_relu(data, batch_sizes, hx, params, ...): each slot's
    rows (and its initial states, on dimension 1) combined, the output's rows and the final
    states taking their slot's."""
    slot = slots(sizes, data.device)  # (N,)
    rows = reduce(trace.owner(data), [1], keepdim=False).expand(data.shape[0]).contiguous()
    base = torch.full((int(sizes[0]) if len(sizes) else 0,), NONE, device=data.device)
    per = segment_combine(base, slot, rows)  # (B,) by slot
    states = hx if isinstance(hx, (list, tuple)) else (hx,)
    parts = [reduce(trace.owner(h), [0, 2], keepdim=False) for h in states]
    parts += [reduce(trace.owner(p), range(p.dim()), keepdim=False) for p in tensors_in(args, {})]
    per = combine(per, *(p.reshape(-1) for p in parts))
    return (per[slot].view(-1, 1), *(per.view(1, -1, 1) for _ in states))


PACKED = {"_pack_padded_sequence": _pack, "_pad_packed_sequence": _pad}
