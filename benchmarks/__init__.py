"""kvpass's benchmark harnesses and their results (not part of the installed library): run the scripts from a
checkout (``python benchmarks/speed.py``); ``benchmarks.bench`` holds the speed benchmark's code."""
