"""Run labels one end sets and the other reads (free-form labels are the user's own).

An agent adds these at registration to say what it saw of the run's code; the auditor reads them
to explain a difference they account for.
"""

BATCH_STATS_LABEL = "local_batch_stats"
"""The BatchNorm sites (SyncBatchNorm aside) of a data-parallel run, joined by ", ": in training
each normalizes its rank's share of the batch with that share's statistics."""
