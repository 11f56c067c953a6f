"""The reads at a model's top level: a read with a recipe that no module call but the model's
own can hold (a timm ViT's ``cls_token.expand(B, ...)`` and ``+ pos_embed``), served by it over
the whole forward of a replayed batch, as a light region (``light.py``) serves its own."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..capture import Use
from ..plan import Plan
from .light import LightRegion
from .recipes import Recipe


class RootReads(LightRegion):
    """The reads of a replayed batch outside every region call and every call of their
    parameters' modules (a ViT's ``cls_token`` and ``pos_embed`` at the model's top level),
    served by their recipes as a light region serves its own, in the analysed order, over the
    whole forward; ``ruled(p)``: whether a call of the module whose rule serves ``p`` is under
    way (its reads there are the rule's). The replay's witness between its events stands for
    the autograd nodes before each read."""

    def __init__(self, plan: Plan, recipes: Sequence[Recipe], batch: int, ruled: Callable, buffers):
        super().__init__(plan, recipes, None, batch, ruled, buffers)

    def finish_reads(self) -> str | None:
        """The forward's end: why the batch's reads are not the analysed ones, or None."""
        self.close()
        if self.why:
            return self.why
        return "fewer reads than the analysed batch's" if self._next != len(self.recipes) else None


def in_order(reads: list[Use]) -> list[Use]:
    """Reads in the order the forward made them (their gradients' nodes were made then)."""
    return sorted(reads, key=lambda u: u.edge.node._sequence_nr())
