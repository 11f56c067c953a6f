"""The engine: which rule serves each parameter (``plan``), the analysis of a batch
(``analysis/``) and the pass that replays it (``passes/``); ``README.md`` draws it. The rest of
gradscope imports it from here."""

from .engine import BatchScores, Engine, Observe, total
from .passes.check import CheckReport, compare_with_loop, render_plan, render_report
from .passes.forward import Forward, select_output
from .passes.influence import (
    ENGINES,
    MAX_PER_REF,
    BatchInfluence,
    Influence,
    check_engine,
    influence_errors,
    reference_gradients,
)
from .passes.naive import naive_grads
from .passes.reduce import Want
from .plan import (
    BROADCAST,
    EXCLUDED,
    FALLBACK,
    FALLBACK_LOOP,
    ParamPlan,
    Plan,
    build_plan,
    prepared,
)

__all__ = [
    "BROADCAST",
    "ENGINES",
    "EXCLUDED",
    "FALLBACK",
    "FALLBACK_LOOP",
    "MAX_PER_REF",
    "BatchInfluence",
    "BatchScores",
    "CheckReport",
    "Engine",
    "Forward",
    "Influence",
    "Observe",
    "ParamPlan",
    "Plan",
    "Want",
    "build_plan",
    "check_engine",
    "compare_with_loop",
    "influence_errors",
    "naive_grads",
    "prepared",
    "reference_gradients",
    "render_plan",
    "render_report",
    "select_output",
    "total",
]
