"""Quality evaluation of kvpass policies against the full cache (issue 3).

``niah``: needle-in-a-haystack accuracy (query-aware and query-agnostic), ``ppl``: perplexity with
teacher forcing through decode steps, ``fidelity``: per-layer attention-output error and top-B
recall, ``leaderboard``: all three for policies x budgets. ``store`` keeps every case in a JSON file
so runs resume; ``cli`` registers the ``kvpass eval`` subcommands.
"""
