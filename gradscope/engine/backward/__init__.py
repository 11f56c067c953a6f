"""The one backward and what runs inside it: each output gradient handed on as it arrives
(``backward``), to its rule or read's parts (``serve``; small alike calls together: ``grouped``),
then reduced to what the question wants (``reduce``); and the fallback for what no rule serves
(``fallback``, with the model's parameters swapped: ``substitute``)."""
