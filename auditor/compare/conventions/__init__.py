"""Conventions inferred from the evidence: how each run reduced its loss over its dp ranks, and
what that makes its activation gradients (docs/comparison.md, "Conventions from the evidence").

The agent cannot see how the user's code normalizes its loss. It records each rank's loss as a mean
over the rank's share (capture's default reduce="mean" for phase loss) and its activation gradients
as dp_size x those of one process (the per-rank mean loss of ordinary DDP/FSDP code,
agents/capture/normalization.py). Code that normalizes by the global token count and sums gradients
over ranks (torchtitan), or plain sums, break both guesses, and every data-parallel pair would read
"scaled by 0.50" ahead of the real bug. So after a first evaluation under the declared conventions,
the evaluation (`auditor.compare.evaluation`) tries the other one on the evidence, each convention
judged on its own evidence:

- loss: a run whose per-rank losses merge into the other run's loss as a sum, and not as a
  mean, is taken as summing (`auditor.compare.conventions.loss_reduction`) unless the parameter
  gradients carry the very factor the mean leaves on the loss (or cannot vouch for the step: not
  captured, all zero). A declared normalization that sums (loss_normalization "global_mean")
  is taken at its word; a reduction the capture declared (reduce="sum") is not second-guessed.
- activation gradients: when every breaching activation gradient is the reference times one
  factor g = n or 1/n beyond the scales the runs' agents inferred (not declared), under the
  corrected scale every activation gradient passes, and the parameter gradients can vouch for
  the step and do not carry g themselves, the scale is taken from the evidence.

Parameter gradients that differ otherwise (a bucket left unreduced, a frozen parameter, one
microbatch trained) are the finding, not evidence against a convention
(`auditor.compare.conventions.grad_evidence`). Each inference is one convention for the whole run,
is said in the report's warnings and on every key it touched; a factor no convention explains is a
finding said with its name (`auditor.compare.explain.factors`). Under the exact metric (the bitwise
preset), activation gradients that are exactly the reference times the factor a convention
implies pass, and the warnings say how many.

Owns the decisions, one module per convention: `loss_reduction` (a run's per-rank losses merged as
sums or means), `activation_grads` (the scale of phase bwd: declared, or the one factor the
evidence shows) and `grad_evidence` (what the parameter gradients say about a factor seen
elsewhere). Hand-offs: each decision takes a `Comparison` made under the declared conventions and
returns what to evaluate again; `auditor.compare.evaluation` runs the evaluations and keeps the
one the evidence supports.
"""
