"""The analysis of a batch (``analyse``): the row trace (``trace``, ``follow``, ``arguments``,
``lanes``, ``owners``, ``contractions``; the owners of the values that pick: ``selectors``),
the tap (``tap``, ``functions``, ``broadcasts``, ``experts``), the module capture and its rows
policy (``session``, ``policy``), the regions later batches analyse again (``finder``,
``visits``, ``children``; one region call's trace and tap in a replayed batch: ``seeded``),
the decisions and self-check (``decide``, ``selfcheck``); ``program`` keeps its outcome for
the replay."""
