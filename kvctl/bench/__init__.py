"""kvctl.bench: real GET (and SET) bandwidth of the remote KV tier (issue 4, paper Fig. 3).

* :mod:`.worker`   one client process: preallocated buffers, pipelined batches
* :mod:`.info`     INFO commandstats/stats snapshots and deltas (redis-py)
* :mod:`.runner`   targets → prepopulated keys → worker processes → raw results
* :mod:`.results`  typed results and ``summarize_*`` (no rendering here)
* :mod:`.stats`    the one percentile definition (linear interpolation)
"""
