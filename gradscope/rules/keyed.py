"""Each row's expert from a grouped product's offsets, and how many rows each key of a keyed
routed read (``routed.Routed.keyed``) holds, read on the host once for every read that keys the
same rows the same way: a routed layer's experts (HF Mixtral's gate-up and down) are two grouped
products of one offsets tensor on rows of the same examples, whose keys are then the same: one
host read for both, where each read took its own (W9: 4 a pass, not 8). A training step's norms
and batch sum from them (``keyed_sums``): each key's G formed, or its Gram taken where it holds
few rows."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .base import BLOCK, _sq_norm

# A training step's key whose Gram costs at most this many times its G's size, n^2 (out + in) <=
# GRAM_FORMED out in, takes its norm from its Gram, its rows in its expert's one product for the
# sum: no G of its own written, read and added (W9: keys of 1 to 256 rows, 22 a read of 40 or
# fewer; its routed reads of a step, replayed alone, 10% less CPU time than with every key's G
# formed, the same at 4, 8, 16 and 32)
GRAM_FORMED = 8
# offsets -> the rows' examples (a weak reference), and the counts by what else they were of
_READ = WeakIdKeyDictionary()


def experts_of(offs: Tensor, rows: int) -> Tensor:
    """(rows,) the group of ``offs`` (cumulative row ends) each row falls in; ``len(offs)`` for
    a row past the last."""
    at = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, at, right=True)


def key_counts(by: Tensor, keys: int, offs: Tensor | None, own: Tensor, form: tuple) -> list[int]:
    """(keys,) how many rows ``by`` (each row's key, ``keys`` for none) puts in each key, on the
    host: those read before for the same ``offs`` and examples ``own`` (the same tensors,
    neither written since) keyed the same ``form`` (experts, batch, rows, which rows are apart),
    else read now. Without offsets (a read of rows a value picked, or merged) always read."""
    if offs is None or offs.is_inference() or own.is_inference():
        return _read(by, keys)
    held = _READ.get(offs)
    if held is None or held[0]() is not own:
        held = _READ[offs] = (weakref.ref(own), {})
    of = (own._version, offs._version, keys, form)
    if of not in held[1]:
        held[1][of] = _read(by, keys)
    return held[1][of]


def _read(by: Tensor, keys: int) -> list[int]:
    return torch.bincount(by, minlength=keys)[:keys].tolist()


def gram_sq(left: Tensor, right: Tensor) -> Tensor:
    """(1,) ||left^T right||^2 from the (n, n) Grams of both sides: n rows of one key."""
    return ((left @ left.T) * (right @ right.T)).sum().reshape(1)


def keyed_sums(
    left: Tensor, right: Tensor, by: Tensor, counts: list[int], batch: int
) -> tuple[list[int], list[Tensor], Tensor]:
    """Each key's squared norm (its example ``at``, its ``each``: (1,) a key, or one (n,) for
    the last n of ``at``) and (E, out, in) every
    expert's sum of its keys' G = left^T right over the key's rows: ``by`` (S,) each row's key
    (example b's by expert x: b E + x; B E for none), ``counts`` (B E,) how many rows each holds,
    on the host. An expert's keys of few rows (``GRAM_FORMED``) by their Grams, their rows in
    one product of the expert's for its sum; each other key's G formed once, into the expert's
    sum where it is the first, else into one buffer, read back for its norm and added to the
    sum (the cache still holds it)."""
    keys, (o, i) = len(counts), (left.shape[1], right.shape[1])
    e = keys // batch
    gram = [n * n * (o + i) <= GRAM_FORMED * o * i for n in counts]
    formed = torch.tensor([not g for g in gram] + [False], device=by.device)[by]
    # rows by expert, its Gram keys' rows first, each key's together; rows of none past all
    rank = (by % e) * (2 * batch) + formed * batch + by // e
    order = torch.argsort(torch.where(by < keys, rank, 2 * keys), stable=True)
    total, work = left.new_empty(e, o, i), left.new_empty(o, i)
    at, each, lo = [], [], 0
    # the formed keys' G by BLOCK, each's reduced into a row as it is formed, all squared and
    # summed at the end: one op a key, not _sq_norm's six (W9: 260 keys a step)
    blocks = left.new_empty(gram.count(False), o * i // BLOCK) if o * i % BLOCK == 0 else None
    formed_at: list[int] = []
    for x in range(e):
        mine = range(x, keys, e)  # expert x's keys, by example
        m = sum(counts[k] for k in mine if gram[k])
        if m:
            rows = order[lo : lo + m]
            ls, rs = left.index_select(0, rows), right.index_select(0, rows)  # (m, out), (m, in)
            torch.matmul(ls.T, rs, out=total[x])  # (out, in) = (out, m) @ (m, in)
            j, lo = 0, lo + m
            for k in mine:
                if gram[k] and counts[k]:
                    each.append(gram_sq(ls[j : j + counts[k]], rs[j : j + counts[k]]))
                    at.append(k // e)
                    j += counts[k]
        held = m > 0  # whether total[x] holds a sum yet: if not, the first G formed there
        for k in mine:
            if not gram[k]:
                rows, g = order[lo : lo + counts[k]], work if held else total[x]
                torch.matmul(left.index_select(0, rows).T, right.index_select(0, rows), out=g)
                if blocks is None:
                    each.append(_sq_norm(g.view(1, -1)))
                    at.append(k // e)
                else:
                    torch.linalg.vector_norm(g.view(-1, BLOCK), dim=-1, out=blocks[len(formed_at)])
                    formed_at.append(k // e)
                if held:
                    total[x] += work
                held, lo = True, lo + counts[k]
        if not held:  # no row of the batch ran expert x
            total[x].zero_()
    if formed_at:
        at, each = at + formed_at, [*each, blocks.square_().sum(-1)]
    return at, each, total
