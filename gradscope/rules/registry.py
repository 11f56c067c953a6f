"""The registry of layer rules: which rule serves a module, and what the engine must know to
feed it.

A rule is a pure function ``(module, inputs, grad_output, **kwargs) -> {param_name: Contribution}``
for one call of one module: ``inputs`` are the call's leading positional tensors, ``kwargs`` its
other arguments by name; each Contribution (``base.py``) holds one parameter's per-example
gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from torch import Tensor, nn

from .base import Contribution

# (module, tensor inputs, output grad, **the call's other arguments by name) -> {attr: part}
RuleFn = Callable[..., dict[str, Contribution]]
# module -> how many trailing dimensions of its leading input are features, for a rule that
# treats every other dimension as rows (Linear: 1, Embedding: 0); None: not row by row
RowsFn = Callable[[nn.Module], int | None]
# (module, tensor inputs) -> the dimension of the call's inputs that indexes examples, for a rule
# that is not row by row; None when no dimension does (an unbatched call)
BatchDimFn = Callable[[nn.Module, tuple[Tensor, ...]], int | None]
# module -> a key: modules of equal keys are alike to the rule (see Rule)
AlikeFn = Callable[[nn.Module], Hashable]
# (module, tensor inputs, other arguments by name) -> for a call whose leading input's positions
# are cut into bags, each the rule's row of examples: the (N,) bag of each position and the
# bags' count; None for a call of rows
BagsFn = Callable[[nn.Module, tuple[Tensor, ...], dict], tuple[Tensor, int] | None]


@dataclass(frozen=True)
class Rule:
    """A rule and what the engine must know to feed it.

    ``submodules`` names child modules whose parameters the rule serves, keyed ``"child.attr"``
    in its result: the module uses them functionally, so the child's own hook never fires
    (``nn.MultiheadAttention`` and its ``out_proj``). ``rows`` marks a rule that works row by
    row (each row's output from that row's input alone): it gives the number of trailing feature
    dimensions of the leading input, and the engine can then hand it a call in any layout of
    rows (tokens flattened to (B*T, D), sequence-first, the tokens routed to one expert), each
    example's rows gathered into a (B, L, *features) batch. Other rules read examples on one
    dimension of their inputs: ``batch_dim`` says which (by default 0). ``alike`` keys the
    modules a rule treats alike: it reads of them nothing their keys do not say (shapes, eps;
    never a parameter's values), and each example's contributions come from that example's
    inputs and output gradient alone, so calls of modules with equal keys on inputs of one shape
    may be answered by one run of the rule over their examples stacked (the twelve ``c_attn``
    calls of a GPT-2 backward). ``bags`` marks a rule whose examples are bags of its leading
    input's positions (``nn.EmbeddingBag`` with offsets): the engine checks that bag i's
    positions are all example i's, whatever the other inputs' owners (offsets are positions).
    """

    name: str
    fn: RuleFn
    submodules: tuple[str, ...] = ()
    rows: RowsFn | None = None
    batch_dim: BatchDimFn | None = None
    alike: AlikeFn | None = None
    bags: BagsFn | None = None


RULES: dict[type[nn.Module], Rule] = {}
# Layers of model libraries, recognised without importing the library: by qualified class name
# ("transformers.pytorch_utils.Conv1D"), then by a structural predicate, in registration order.
# Recognition may be wrong (a class of the same name or shape doing other math); the engine's
# first-batch self-check moves a parameter whose rule does not reproduce autograd to the fallback.
NAMED: dict[str, Rule] = {}
MATCHERS: list[tuple[Callable[[nn.Module], bool], Rule]] = []


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class, as NAMED keys it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def register_rule(
    *types: type[nn.Module],
    name: str,
    submodules: tuple[str, ...] = (),
    rows: RowsFn | None = None,
    batch_dim: BatchDimFn | None = None,
    qualnames: tuple[str, ...] = (),
    match: Callable[[nn.Module], bool] | None = None,
    alike: AlikeFn | None = None,
    bags: BagsFn | None = None,
) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as the rule for modules of exactly these types, of classes with these
    qualified names, and of any module ``match`` accepts (checked after types and names)."""

    def register(fn: RuleFn) -> RuleFn:
        rule = Rule(name, fn, submodules, rows, batch_dim, alike, bags)
        for t in types:
            RULES[t] = rule
        for qualname in qualnames:
            NAMED[qualname] = rule
        if match is not None:
            MATCHERS.append((match, rule))
        return fn

    return register


def find_rule(module: nn.Module) -> Rule | None:
    """The rule for ``module``'s exact type, or a parent's when the subclass keeps its forward;
    else the rule of its qualified class name, else the first whose predicate accepts it."""
    cls = type(module)
    if cls in RULES:
        return RULES[cls]
    for parent in cls.__mro__[1:]:
        if parent in RULES and cls.forward is parent.forward:
            return RULES[parent]
    if (named := NAMED.get(qualified_name(cls))) is not None:
        return named
    return next((rule for match, rule in MATCHERS if match(module)), None)


def read_by_bags(module: nn.Module, inputs: tuple, kwargs: dict) -> bool:
    """Whether ``module``'s rule reads its call on ``inputs`` (its leading tensors, a packed
    sequence spread) by bags (``Rule.bags``: a packed RNN's slots, an EmbeddingBag's offsets),
    not by rows: a padded RNN's call and a (B, L) EmbeddingBag's are read by rows."""
    rule = find_rule(module)
    return (
        bool(inputs)
        and rule is not None
        and rule.bags is not None
        and (rule.bags(module, inputs, kwargs) is not None)
    )
