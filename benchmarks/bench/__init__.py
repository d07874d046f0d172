"""The speed benchmark (``benchmarks/speed.py``, ``kvpass bench``) by job: ``models`` (the random-weight
Llamas), ``timing`` (timers), ``kernels`` (the op sections), ``e2e`` (end to end and throughput), ``report``
(Markdown, plots), ``main`` (the sections in order, the command line), ``tp`` (the tensor-parallel benchmark)."""
