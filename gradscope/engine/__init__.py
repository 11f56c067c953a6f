"""The engine: which rule serves each parameter (``plan``), the analysis of a batch
(``analysis/``), the replay of an analysed one (``replay/``) and the one backward with the rules
inside it (``backward/``), run by ``Engine`` (``engine.py``); above it, the influence engines
(``influence``, ``jvp``), ``gradscope check`` (``check``), the loop oracle (``naive``) and how a
model is called (``forward``). ``README.md`` draws it. The rest of gradscope imports it from
here."""

from .analysis.selfcheck import computed_in
from .analysis.undrawn import Drew, Undrawn
from .backward.fallback import short_reason
from .backward.reduce import Want
from .backward.substitute import substituted
from .check import (
    CheckReport,
    compare_with_loop,
    influence_errors,
    render_plan,
    render_report,
)
from .eager import prepared
from .engine import Engine, Observe
from .forward import Forward, batched, select_output
from .influence import (
    ENGINES,
    MAX_PER_REF,
    BatchInfluence,
    Influence,
    check_engine,
    non_finite_rows,
    reference_gradients,
)
from .naive import naive_grads
from .plan import (
    BROADCAST,
    EXCLUDED,
    FALLBACK,
    FALLBACK_LOOP,
    ParamPlan,
    Plan,
    build_plan,
)
from .scores import BatchScores, total

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
    "Drew",
    "Engine",
    "Forward",
    "Influence",
    "Observe",
    "ParamPlan",
    "Plan",
    "Undrawn",
    "Want",
    "batched",
    "build_plan",
    "check_engine",
    "compare_with_loop",
    "computed_in",
    "influence_errors",
    "naive_grads",
    "non_finite_rows",
    "prepared",
    "reference_gradients",
    "render_plan",
    "render_report",
    "select_output",
    "short_reason",
    "substituted",
    "total",
]
