"""The reads at a model's top level: a read with a recipe that no module call but the model's
own can hold (a timm ViT's ``cls_token.expand(B, ...)`` and ``+ pos_embed``), served by it over
the whole forward of a replayed batch, as a light region (``light.py``) serves its own; and the
scalars of the batch's values read on the host outside every region call (transformers'
``pad_token_id in input_ids``, a mask skipped where nothing is padded), witnessed as a light
region witnesses its own."""

from __future__ import annotations

from collections.abc import Callable

from ..capture import Use, counter
from ..plan import Plan
from ..steps import Program
from .intercept import Intercept
from .light import LightRegion


class RootReads(LightRegion):
    """The reads of a replayed batch outside every region call and every call of their
    parameters' modules (a ViT's ``cls_token`` and ``pos_embed`` at the model's top level),
    served by their recipes as a light region serves its own, in the analysed order, over the
    whole forward; ``ruled(p)``: whether a call of the module whose rule serves ``p`` is under
    way (its reads there are the rule's). The replay's witness between its events stands for
    the autograd nodes before each read."""

    def __init__(
        self,
        plan: Plan,
        program: Program,
        batch: int,
        ruled: Callable,
        buffers: frozenset[int],
        outside: Callable[[], bool],
        branched: Callable[[], None],
        intercept: Intercept | None = None,
        owned: list | None = None,
    ):
        hosts, root = program.hosts, program.root
        super().__init__(
            plan, root, None, batch, ruled, buffers, (), hosts, branched, intercept, owned
        )
        self.outside = outside  # whether no region call is under way

    def _host(self, func, args: tuple, kwargs: dict) -> object:
        if not self.outside():  # a region call's: its own witness sees it, or its trace
            return func(*args, **kwargs)
        return super()._host(func, args, kwargs)

    def spent(self) -> bool:
        """Whether the batch has made every analysed read and host read, each as analysed: the
        forward runs on as the analysed one did from here (the same Python, on the same
        shapes, having read the same values), so no op need be seen any more."""
        return (
            not self.why and self._next == len(self.recipes) and self._host_next == len(self.hosts)
        )

    def missed(self) -> bool:
        """Whether its reads are intercepted and the batch has made as many autograd nodes as
        the analysed one had by the end of its next read, without making it: a read the
        interception did not see (a parameter reached by another way than its modules'
        attributes), the failure a later step's witness finds first (the read's own nodes
        not made)."""
        if not self.intercepts or self._next >= len(self.recipes):
            return False
        return counter() - self._start >= self.recipes[self._next].at

    def finish_reads(self) -> str | None:
        """The forward's end: why the batch's reads are not the analysed ones, or None."""
        why = self._missing()
        if why and self.intercepts:
            self.intercept.failed()
        return why

    def _missing(self) -> str | None:
        self.close()
        if self.why:
            return self.why
        if self._next != len(self.recipes):
            return "fewer reads than the analysed batch's"
        if self._host_next != len(self.hosts):
            return "fewer values read on the host than the analysed batch's"
        return None


def in_order(reads: list[Use]) -> list[Use]:
    """Reads in the order the forward made them (their gradients' nodes were made then)."""
    return sorted(reads, key=lambda u: u.edge.node._sequence_nr())
