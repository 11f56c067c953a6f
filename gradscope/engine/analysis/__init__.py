"""The analysis of a batch: the row trace (``trace``, ``follow``, ``lanes``, ``ops``,
``owners``), the tap (``tap``, ``functions``, ``broadcasts``, ``derived``, ``views``, ``bind``),
the module capture and its rows policy (``session``, ``policy``), the decisions and self-check
(``decide``, ``selfcheck``), driven by ``analyse``; ``program`` keeps its outcome for replay."""
