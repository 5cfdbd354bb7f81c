"""Run labels one end sets and the other reads (free-form labels are the user's own).

An agent adds these at registration to say what it saw of the run's code; the auditor reads them
to explain a difference they account for.
"""

BATCH_STATS_LABEL = "local_batch_stats"
"""The BatchNorm sites (SyncBatchNorm aside) of a data-parallel run, joined by ", ": in training
each normalizes its rank's share of the batch with that share's statistics."""

DROPOUT_LABEL = "dropout_sites"
"""The module sites of a run that draw random masks in training (dropout modules with p > 0,
MultiheadAttention with dropout > 0), joined by ", ": two runs whose random streams differ (another
data-parallel split, pipeline schedule or seed) drop different elements there."""

TIED_LABEL = "tied_parameters"
"""The parameters a run's model holds under more than one name (an output head tied to the token
embedding), as "alias=name" entries joined by ", ": the agent captures each such parameter once,
under its first name (`named_parameters()`), so the alias has no captures of its own."""

CAPTURE_DEPTH_LABEL = "capture_max_depth"
"""The agent's max_depth: modules deeper than this many dotted levels are not hooked, so they
have no activation (fwd) or activation-gradient (bwd) captures of their own."""

BLOCK_DEPTH_LABEL = "capture_block_depth"
"""The agent's block_depth: inside a repeated block (a child of a ModuleList or ModuleDict, such
as ``layers.3``) modules this many levels down are hooked even past max_depth; 0 = none."""

BLOCK_LISTS_LABEL = "block_lists"
"""The sites of a run's ModuleLists and ModuleDicts, joined by ", ": their children are the
repeated blocks block_depth counts from (``model.layers`` for ``model.layers.3``)."""

UNPASSED_MESH_LABEL = "unpassed_mesh"
"""Set ("1") by a rank attached without a device mesh whose model holds DTensors: the job has a
mesh the agent was not given, so the auditor may advise passing it (to name mesh dims); a plain
DDP job has none, and is told nothing of the kind."""
