"""The pass: the replayed capture (``replay``), the one backward (``backward``), the reductions
(``reduce``), the fallback (``fallback``, ``naive``), how the model is called (``forward``), and
the influence engines (``influence``, ``jvp``) and ``gradscope check`` (``check``) above it."""
