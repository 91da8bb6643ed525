"""The call path behind ``CompressedComm`` (``mpicomp.comm``, the façade): what the
constructor's arguments resolve to (``options``, ``arguments``), the configuration every
rank must share (``config``, ``same_call``), what a call takes in and gives back
(``intake``), where the ranks are and what a call of n elements runs (``placement``),
and where started calls run (``worker``, ``threads``). docs/architecture.md maps it."""
