"""Capture: what the agent hooks in the model and decides to capture, on the training thread.

Owns the hooks and how they run under torch.compile (`hooks`), the module and parameter hooks and
the parameter sweeps (`capture`: the `Capturer`; its module and gradient hooks in `module_hooks`,
where each captured piece sits in `piece_layouts`, its cached fused-kernel fast path in
`fused_plans`), where a module's output sits across tensor-parallel ranks and DTensors read as
their bytes (`sharding`), the names of sites whatever wraps a module (`sites`), FSDP1's flat
parameters seen as the originals (`fsdp1`), operations inside named modules (`ops`), the
optimizer's phases optim_grad and update (`optimizer`), state dicts as the auditor keys them
(`state`) and the run's declared loss normalization (`normalization`). (The drill-down plan
applied to the configuration is the configuration's: `agents.config.apply_plan`.)

Hand-offs: it receives the model, the `AgentConfig` and the `RankIdentity` from `agents.agent`;
each captured tensor, with its place in the logical tensor (`agents.layout.PieceLayout`), goes
to the digest's `Batcher` (`agents.digest.batching`), which digests it before the hook returns
and hands host batches to the sink the agent injected (the sender, `agents.delivery`). Capture
never imports delivery: the auditor's directives reach `ops` through the inbox the agent shares
with the sender's ack reader.
"""
