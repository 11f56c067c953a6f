"""What lets forward mode score a batch (``influence.Influence``'s jvp engine): the hooks'
proof that the batch's signature keeps its examples apart, at the model's state now."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .steps import RegionCall

if TYPE_CHECKING:
    from .record import Findings


def proven(findings: Findings) -> bool:
    """Whether forward mode may score the batches of a signature: the hooks' analysis found
    its examples apart and self-checked a program whose forward is the same calls whatever the
    values (no region traced, routed by the values or reading them on the host; light regions,
    whose parameter reads a recipe serves, are), at the model's state now. Forward mode runs
    the model as it is, with no analysis and no witness of its own: on a model that mixes the
    examples of a batch it would give each example the batch's derivative without a word."""
    if not (findings.verified and findings.programs):
        return False
    program = findings.programs[-1]
    fixed = all(
        s.light is not None and not (s.routed or s.open or s.hosts)
        for s in program.steps
        if isinstance(s, RegionCall)
    )
    return fixed and not program.hosts and program.state.differs() is None
