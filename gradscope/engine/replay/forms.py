"""Forms: the example of each row of a routed region's tensor (``rowflow.py``) as a function of
the row's position alone, where the ops that made it say so whatever the batch's values: rows
gathered by a sort's permutation, split, put back by its inverse and merged again, as grouped
experts' are. Two rows tensors of one form are equal on every batch, so the flags that compare
them (rows meeting, rows merged, the outputs' rows against the analysed ones) need not be read:
a routed region whose every flag a form settles reads nothing on the host.

A form ``(m, maps)`` says that row i is example ``(f(i) // m) % B``, f the maps applied to i in
order: ``(REP, k)`` takes i to ``i // k``, ``(PICK, p)`` to ``P[i]`` and ``(INV, p)`` to
``P⁻¹[i]``, for a permutation P of its positions (a 1-D sort's indices) known by ``p``, its id
while the flow holds it. An index tensor's form is its maps alone: its value at i is f(i).
"""

from __future__ import annotations

REP, PICK, INV = "rep", "pick", "inv"

Maps = tuple[tuple[str, int], ...]
Form = tuple[int, Maps]


def normal(m: int, maps: Maps) -> Form:
    """One spelling of each form: a permutation and its inverse cancel, ``i // a // b`` is
    ``i // (a * b)``, and a last ``i // k`` goes into m."""
    out: list[tuple[str, int]] = []
    for step in maps:
        last = out[-1] if out else None
        if last is not None and last[1] == step[1] and {last[0], step[0]} == {PICK, INV}:
            out.pop()  # P[P⁻¹[i]] = P⁻¹[P[i]] = i
        elif last is not None and last[0] == REP and step[0] == REP:
            out[-1] = (REP, last[1] * step[1])
        else:
            out.append(step)
    while out and out[-1][0] == REP:
        m *= out.pop()[1]
    return m, tuple(out)


def picked(index: Maps, form: Form) -> Form:
    """``x[I]``'s rows: row i is x's row I(i)."""
    return normal(form[0], index + form[1])


def split(form: Form, k: int) -> Form:
    """Each row split into k (a reshape): row i is x's row i // k."""
    return normal(form[0], ((REP, k), *form[1]))


def merged(form: Form, k: int) -> Form | None:
    """k consecutive rows merged into one (a reshape), where the form says they are one
    example's: row j is x's rows jk .. jk + k - 1; None where it does not say."""
    m, maps = form
    if maps and maps[0][0] == REP and maps[0][1] % k == 0:  # (jk + r) // (ak) = j // a
        rest = maps[1:] if maps[0][1] == k else ((REP, maps[0][1] // k), *maps[1:])
        return normal(m, rest)
    if not maps and m % k == 0:
        return m // k, ()
    return None
