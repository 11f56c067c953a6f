"""The plan: for every parameter, which rule serves it, the fallback, or excluded by ``params``.

A parameter is served by the rule of the modules holding it. A rule may also serve the
parameters of child modules its module uses functionally (the attention rule and
``nn.MultiheadAttention.out_proj``): those are held by the parent too, under ``"out_proj.weight"``.
A parameter held only by modules without a rule (a ViT's ``cls_token``, a LayerScale ``gamma``)
is ``broadcast`` while the passes see it read only where the tap serves it (``analysis/tap.py``):
in broadcast elementwise ops, and by ``F.linear``, ``matmul`` and ``F.embedding``, whole or
through a view (a fused expert's ``W[e]``, ``W.T``, ``1 + w``). Everything else goes to the fallback (exact per-example gradients
through torch.func, ``backward/fallback.py``), with the reason in ``note``, through
``Plan.to_fallback``: a module with a rule beside one without, a raw parameter read by another op,
and what the passes show a rule cannot see (a parameter reaching the loss without a call of its
module, output rows that are not the examples, a second output reaching the loss, per-example
gradients that do not add up to autograd's batch gradient). Rule strings: a rule's name (tied
parameters join them: "embedding+linear"), ``broadcast``, ``fallback`` (vmap), ``fallback:loop``
(one backward per example: vmap could not run the model, or a hook on the parameter's gradient
must run on each example's), ``excluded``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from torch import nn

from ..errors import ConfigError
from ..rules import find_rule
from ..rules.registry import Rule

BROADCAST = (
    "broadcast"  # a raw parameter read in broadcast elementwise ops (analysis/broadcasts.py)
)
FALLBACK = "fallback"
FALLBACK_LOOP = "fallback:loop"
EXCLUDED = "excluded"


@dataclass
class ParamPlan:
    name: str  # the name model.named_parameters() gives it
    param: nn.Parameter
    module: str  # the module it is reported under with --per-layer
    owners: list[tuple[nn.Module, str]] = field(
        default_factory=list
    )  # (module, attribute) per holder
    rule: str = EXCLUDED  # "linear", "conv+linear" (tied), FALLBACK, FALLBACK_LOOP or EXCLUDED
    note: str = ""  # why the fallback serves it

    @property
    def included(self) -> bool:
        return self.rule != EXCLUDED

    @property
    def is_fallback(self) -> bool:
        return self.rule in (FALLBACK, FALLBACK_LOOP)


# how the parameters were selected (``Plan.selection``)
INCLUDE = "include"  # params.include named them
TRAINABLE = "trainable"  # no params.include: the parameters that require grad
ALL = "all"  # no params.include and none requires grad (a model loaded for inference): all
SELECTIONS = {
    INCLUDE: "the parameters params.include names, less params.exclude",
    TRAINABLE: "no params.include: the parameters that require grad, less params.exclude",
    ALL: "no params.include and no parameter requires grad: all of them, less params.exclude",
}


@dataclass
class Plan:
    params: list[ParamPlan]
    selection: str = INCLUDE  # INCLUDE, TRAINABLE or ALL
    # name -> (note, loop) of every move to the fallback: the record's (record.py), which every
    # Engine of the same model and selection shares and adopts whole
    moves: dict[str, tuple[str, bool]] = field(default_factory=dict)
    _by_name: dict[str, ParamPlan] = field(init=False, repr=False, compare=False)
    # what the properties below derive from the rules, kept until a rule changes (``_moved``):
    # every pass asks for them several times, and a large model has hundreds of parameters
    _derived: dict[str, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_name = {p.name: p for p in self.params}

    def _kept(self, key: str, make: Callable[[], object]):
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def _moved(self) -> None:
        self._derived.clear()

    @property
    def included(self) -> tuple[ParamPlan, ...]:
        return self._kept("included", lambda: tuple(p for p in self.params if p.included))

    @property
    def by_rule(self) -> tuple[ParamPlan, ...]:
        """Served by the rules of the modules holding them."""
        return self._kept(
            "by_rule",
            lambda: tuple(
                p for p in self.params if p.included and not p.is_fallback and p.rule != BROADCAST
            ),
        )

    @property
    def raw(self) -> tuple[ParamPlan, ...]:
        """Held by modules without a rule: served while they are only read in broadcast ops."""
        return self._kept("raw", lambda: tuple(p for p in self.params if p.rule == BROADCAST))

    @property
    def owned(self) -> dict[int, ParamPlan]:
        """id of a parameter -> its plan, for the rule-served and raw ones (a routed region's
        every read is one of them)."""
        return self._kept("owned", lambda: {id(p.param): p for p in self.by_rule + self.raw})

    @property
    def fallback(self) -> tuple[ParamPlan, ...]:
        return self._kept("fallback", lambda: tuple(p for p in self.params if p.is_fallback))

    @property
    def served(self) -> dict[tuple[int, str], ParamPlan]:
        """(id of a holding module, attribute) -> the rule-served parameter it holds there."""
        return self._kept(
            "served", lambda: {(id(m), attr): p for p in self.by_rule for m, attr in p.owners}
        )

    @property
    def serving(self) -> frozenset[int]:
        """ids of the modules whose rules serve a parameter: whose calls the backward reads."""
        return self._kept("serving", lambda: frozenset(module for module, _ in self.served))

    @property
    def rules(self) -> dict[int, Rule]:
        """id of a module whose rule serves a parameter -> that rule: looked up once (a library
        layer's by its structure), asked on every call of the module."""
        return self._kept("rules", lambda: {id(m): find_rule(m) for m in self.hooked_modules})

    @property
    def alike(self) -> bool:
        """Whether two of the modules whose rules serve a parameter are alike to their rule
        (``Rule.alike``): where none are, no pass has calls to answer together
        (``backward/grouped.py``). Read once, as the plan was made (where modules change
        since, their calls are each answered alone, as exact)."""
        return self._kept("alike", self._alike)

    def _alike(self) -> bool:
        rules = self.rules
        keys = [
            (rule.name, rule.alike(m))
            for m in self.hooked_modules
            if (rule := rules.get(id(m))) is not None and rule.alike is not None
        ]
        return len(set(keys)) < len(keys)

    @property
    def hooked_modules(self) -> tuple[nn.Module, ...]:
        """Modules whose calls must be captured: every holder of a parameter a rule serves."""
        return self._kept("hooked", self._hooked)

    def _hooked(self) -> tuple[nn.Module, ...]:
        seen: dict[int, nn.Module] = {}
        for p in self.by_rule:
            for module, _ in p.owners:
                seen.setdefault(id(module), module)
        return tuple(seen.values())

    def find(self, name: str) -> ParamPlan:
        """The plan of the parameter ``name``: by name, asked once per read a pass serves."""
        return self._by_name[name]

    def to_fallback(self, p: ParamPlan, reason: str, loop: bool = False) -> None:
        """Serve ``p`` by the fallback from now on (``loop``: one backward per example), and say
        why in its note."""
        p.rule = FALLBACK_LOOP if loop else FALLBACK
        p.note = f"{p.note}; {reason}" if p.note else reason
        self.moves[p.name] = (p.note, loop)
        self._moved()

    def adopt(self, moves: dict[str, tuple[str, bool]]) -> None:
        """Take over what earlier passes on this model moved to the fallback, and record into
        it from now on."""
        for p in self.included:
            if p.name in moves:
                p.note, loop = moves[p.name]
                p.rule = FALLBACK_LOOP if loop else FALLBACK
        self.moves = moves
        self._moved()

    @property
    def modules(self) -> list[str]:
        """The --per-layer columns, in model order."""
        return list(dict.fromkeys(p.module for p in self.included))

    def describe_selection(self) -> dict[str, str]:
        """Which rule picked the parameters, for the output's metadata."""
        return {"selection": self.selection, "meaning": SELECTIONS[self.selection]}

    def describe(self) -> list[dict[str, object]]:
        return [
            {
                "name": p.name,
                "module": p.module,
                "shape": list(p.param.shape),
                "rule": p.rule,
                "note": p.note,
            }
            for p in self.params
        ]


def _selected(names: Sequence[str], include: Sequence[str], exclude: Sequence[str]) -> bool:
    def hit(patterns: Sequence[str]) -> bool:
        return any(fnmatchcase(n, pat) for n in names for pat in patterns)

    return hit(include) and not hit(exclude)


def _check_patterns(names: list[str], include: Sequence[str], exclude: Sequence[str]) -> None:
    """Each pattern of ``params.include`` and ``params.exclude`` names a parameter: one that
    matches none (a typo) selects, or leaves out, nothing it was written for."""
    for key, pattern in [("include", p) for p in include] + [("exclude", p) for p in exclude]:
        if not any(fnmatchcase(n, pattern) for n in names):
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            what = f"params.{key} pattern {pattern!r} matches no parameter of the model"
            raise ConfigError(f"{what} (its names: {shown})", f"params.{key}")


def trainable(model: nn.Module) -> set[int]:
    """The ids of the parameters that require grad; all of them when none does.

    Read before anything flips ``requires_grad`` (``prepared`` sets it on the selection)."""
    params = list(model.parameters())
    chosen = {id(p) for p in params if p.requires_grad}
    return chosen or {id(p) for p in params}


def build_plan(
    model: nn.Module, include: Sequence[str] | None = None, exclude: Sequence[str] = ()
) -> Plan:
    """Decide, before any pass, how each parameter's per-example gradient is obtained.

    ``include`` None selects the parameters that require grad (a frozen base under LoRA
    adapters is left out), or all of them when none does; names given select explicitly,
    frozen or not. ``exclude`` applies to both.
    """
    include, exclude = ([p] if isinstance(p, str) else p for p in (include, exclude))  # a glob
    selection = INCLUDE
    if include is None:
        chosen = trainable(model)
        selection = TRAINABLE if any(p.requires_grad for p in model.parameters()) else ALL
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    plans: dict[int, ParamPlan] = {}
    for name, p in model.named_parameters():
        plans[id(p)] = ParamPlan(name=name, param=p, module=name.rpartition(".")[0] or name)
    served: dict[int, tuple[nn.Module, str]] = {}  # child -> (parent whose rule serves it, name)
    for module in model.modules():
        rule = find_rule(module)
        for child in rule.submodules if rule else ():
            served[id(getattr(module, child))] = (module, child)
    held: set[tuple[int, str]] = set()
    for module in model.modules():  # each module once, even where it sits at two places
        for attr, p in module.named_parameters(recurse=False):
            holders = [(module, attr)]
            if id(module) in served:  # the parent's calls use it; the child's own calls may too
                parent, child = served[id(module)]
                holders.insert(0, (parent, f"{child}.{attr}"))
            for holder, name in holders:
                if (id(holder), name) not in held:
                    held.add((id(holder), name))
                    plans[id(p)].owners.append((holder, name))
    for plan in plans.values():
        if include is None and id(plan.param) not in chosen:
            continue
        if not _selected(names[id(plan.param)], ("*",) if include is None else include, exclude):
            continue
        rules = [find_rule(module) for module, _ in plan.owners]
        if all(rules):
            # a served child's own rule only covers direct calls of it: the parent's rule names it
            shown = (r for (m, _), r in zip(plan.owners, rules, strict=True) if id(m) not in served)
            plan.rule = "+".join(dict.fromkeys(r.name for r in shown))
        else:  # the passes tell whether the tap serves every read (a rule's module's too)
            plan.rule = BROADCAST
            missing = (
                type(m).__name__ for (m, _), r in zip(plan.owners, rules, strict=True) if r is None
            )
            plan.note = "no rule for " + ", ".join(dict.fromkeys(missing))
    _check_patterns([n for ns in names.values() for n in ns], include or (), exclude)
    plan = Plan(list(plans.values()), selection=selection)
    if not plan.included:
        what = "params.include/exclude select no parameter of the model"
        if include is None:
            what = "params.exclude leaves none of the parameters that require grad"
        raise ConfigError(what, "params")
    return plan
