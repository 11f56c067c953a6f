"""The replay of an analysed batch: the signature's programs tried in turn (``programs``), each
run by module hooks alone outside its regions (``session``); each region call (``region``) under
a fresh trace and tap, or served by its reads' recipes (``light``, ``reads``; ``root`` at the
model's top), its rows followed where the batch's values pick them (``routed``, ``rowflow``,
``rowops``)."""
