"""The `Agent` and `attach`, the one call a training script makes."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from numaudit.agents import shutdown
from numaudit.agents.capture.capture import AUTO, Capturer, Counters, HostBatch
from numaudit.agents.capture.normalization import (
    grad_scale,
    note_batch_norms,
    note_block_lists,
    note_capture_depth,
    note_dropouts,
    note_tied_parameters,
    note_unpassed_mesh,
)
from numaudit.agents.capture.optimizer import OptimizerWatch
from numaudit.agents.config import AgentConfig, apply_env, check
from numaudit.agents.identity import RankIdentity, job_identity, rank_identity

log = logging.getLogger(__name__)

SUMMARY_LOGGER = "numaudit.agents.summary"
"""The logger of the line each rank logs at close (INFO; WARNING when records were spooled or
dropped). Configure it, or `agents`, like any logger; where logging is not configured at all
it writes to stderr by itself, so a first run says what it sent."""


def summary_logger() -> logging.Logger:
    """The close summary's logger: with no handler configured anywhere (a script that never
    set up logging, where Python would show WARNING and above only), one of its own on stderr
    at INFO; otherwise the application's configuration decides."""
    lg = logging.getLogger(SUMMARY_LOGGER)
    if not lg.hasHandlers():
        handler = logging.StreamHandler()  # sys.stderr at the time of the call
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        lg.addHandler(handler)
        if lg.level == logging.NOTSET:  # a level set on it (the auditor's CLI) stays
            lg.setLevel(logging.INFO)
        lg.propagate = False
    return lg


class Backlog(NamedTuple):
    """How far the auditor's acks are behind an agent's captures (`Agent.backlog`)."""

    captured: int
    acked: int
    dropped: int

    @property
    def waiting(self) -> int:
        """Records digested, neither dropped nor acked yet."""
        return self.captured - self.dropped - self.acked


class Agent:
    """Captures one rank's tensors and streams their digests to the auditor.

    After `attach` returns, no method raises into training: failures are counted and logged
    once. `step(i)` and `microbatch(j)` are context managers that key what is captured inside
    them; parameter gradients (and values) are captured when a step block exits, or just
    before an optimizer steps inside it, whichever comes first: before the update and before a
    `zero_grad()` clears them, wherever the training loop calls `optimizer.step()`.
    """

    def __init__(self, config: AgentConfig, ident: RankIdentity) -> None:
        self.config = config
        self.ident = ident
        self.counters = Counters()
        self._models: list[tuple[torch.nn.Module, int]] = []
        self._closed = False
        self._close_lock = threading.RLock()
        """Held for a whole close: a SIGTERM closing from the watcher thread and the main
        thread's handler or own close() wait for each other (agents/shutdown.py)."""
        self._sender = None
        self.active = config.enabled and (config.ranks is None or ident.rank in config.ranks)
        if self.active and not config.run:
            # Records without a run name could be neither stored nor replayed from a spool.
            log.warning("rank %d: numaudit has no run name (run= or NUMAUDIT_RUN): auditing is "
                        "off", ident.rank)
            self.active = False
        if self.active:
            from numaudit.agents.delivery.sender import Sender  # grpc only where auditing is on

            self._sender = Sender(config, ident, self.counters)
            shutdown.register(self)
        self.capturer = Capturer(config, ident, self._sink, self.counters)
        from numaudit.agents.capture.ops import OpCapture

        self.ops = OpCapture(self.capturer, config, ident)
        """Op-level captures (NUMAUDIT_OPS, a plan, the auditor's directives:
        agents/capture/ops.py)."""
        if self._sender is not None and config.directives:
            self._sender.directives = self.ops.inbox
        self._in_step = False
        """Inside a `step` block."""
        self._grads_taken = False
        """This step's parameter gradients are captured (`capture_gradients` inside the block,
        by the user or before an optimizer's step)."""
        self._optimizer_hook = None
        if self.active:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            from numaudit.agents.capture.hooks import not_traced

            self._optimizer_hook = register_optimizer_step_pre_hook(
                not_traced(self._optimizer_stepping))  # a compiled optimizer step: run eagerly

    def _sink(self, batch: HostBatch) -> None:
        if self._sender is not None:
            self._sender.submit(batch)

    @property
    def session_id(self) -> str | None:
        return self._sender.session_id if self._sender is not None else None

    def watch(self, module: torch.nn.Module, *, stage: int = -1, pipelined: bool = False) -> int:
        """Hook a (further) model or pipeline-stage module; returns the number of hooked modules.

        `pipelined` is for agents.pipeline.watch_stages: capture only inside schedule chunks.
        """
        if not self.active:
            return 0
        try:
            self._models.append((module, stage))
            note_batch_norms(self.ident, module)
            note_dropouts(self.ident, module)
            note_tied_parameters(self.ident, module)
            note_block_lists(self.ident, module)
            note_unpassed_mesh(self.ident, module)
            n = self.capturer.hook_modules(module, stage, pipelined=pipelined)
            self.ops.watch(module, stage)
            return n
        except Exception as exc:
            self.capturer._failed("watch", exc)
            return 0

    def watch_optimizer(self, optimizer: torch.optim.Optimizer, *,
                        updates: bool = True) -> OptimizerWatch | None:
        """Capture gradients as `optimizer.step()` consumes them (phase optim_grad: after
        clipping, unscaling, any gradient transformation) and, with `updates`, the change it
        applies to each parameter (phase update). Returns the hooks' handle (`.remove()`),
        or None when the agent is off. See agents/capture/optimizer.py for the cost."""
        if not self.active:
            return None
        try:
            return OptimizerWatch(self.capturer, self._models, optimizer, updates=updates)
        except Exception as exc:
            self.capturer._failed("watch_optimizer", exc)
            return None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Key captures inside the block by `step`; capture parameter gradients at its end."""
        if self.active:
            self.capturer.start_step(step)
            self._in_step, self._grads_taken = True, False
            try:
                if self.ops.start_step(step, self.capturer._step_on):
                    self.capturer._step_on = True  # a directive of the auditor names this step
            except Exception as exc:  # never into training
                self.capturer._failed("op-level capture", exc)
        try:
            yield
        except BaseException:
            # The step failed: its gradients are not the step's (and a rerun under the same run
            # name must not conflict with them). Flush what was captured, then re-raise.
            if self.active:
                self._in_step = False
                self.capturer.flush()
            raise
        if self.active:
            self._in_step = False
            if not self._grads_taken:
                self.capture_gradients()
            self.capturer.flush()
            self.ops.end_step()  # a directive's hooks and payload globs last one step

    def _optimizer_stepping(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        """Every optimizer's step pre-hook (torch's global one): the first optimizer stepping
        inside a step block over parameters of a watched model captures the step's parameter
        gradients and values now, before its update and the `zero_grad()` that usually follows
        (captured at the block's exit, they would all be None, alike in both runs)."""
        if not self._in_step or self._grads_taken or self._closed:
            return
        try:
            watched = {id(p) for module, _ in self._models for p in module.parameters()}
            if any(id(p) in watched for group in optimizer.param_groups for p in group["params"]):
                self.capture_gradients()
        except Exception as exc:  # never into training
            self.capturer._failed("capture_gradients", exc)

    @contextlib.contextmanager
    def microbatch(self, microbatch: int) -> Iterator[None]:
        """Key captures inside the block by `microbatch`."""
        if self.active:
            self.capturer.microbatch = microbatch
        try:
            yield
        finally:
            if self.active:
                self.capturer.flush()

    def capture(self, tensor: torch.Tensor | None, *, site: str, phase: str = "fwd",
                role: str = "value", index: int = 0, microbatch: int | None = None,
                stage: int | None = None, rows=None, backward: bool = False,
                reduce: str | None = AUTO, weight: float | None = None,
                replicate: bool | None = None) -> None:
        """Capture a tensor the hooks cannot see (the loss, the input batch, a custom value).

        `reduce`: "mean" or "sum" when the tensor is this rank's reduction over its batch share
        (the auditor combines the dp ranks' values into the whole batch's); None when it is not.
        The default is "mean" for phase "loss" (a per-rank mean loss) and None otherwise; a
        loss that holds this rank's samples (``reduction="none"``: not 0-dim, as many elements
        on the batch dim as the model's input has samples) is the batch's rows, joined with
        the other dp ranks' like an activation.
        `weight`: batch elements a mean averaged over (default: microbatch_size, else dim 0 of
        this microbatch's `input` capture, else 1). `replicate`: whether the same value is held
        by the other ranks of this dp rank (tp, cp, ep); default from replicate_sites /
        shard_sites, else inferred from the mesh.
        `rows` (an `agents.ragged.RaggedRows`) declares a ragged piece: the tensor's rows are a
        slice of a logical tensor concatenated from parts with different row counts (the tokens
        each dp rank routed to one expert); see agents/ragged.py for getting the offsets.
        `backward`: also capture the gradient that reaches this tensor (phase bwd, role
        grad_output, same layout) when the bwd phase is on.
        """
        if self.active:
            cap: Capturer | None = None  # paused below: resumed at the end
            capturer = self.capturer
            if capturer.op_frames and not capturer.ops_paused:  # inside a module whose ops are
                capturer.ops_paused += 1  # captured: the agent's own digest work is not the model's
                cap = capturer
            try:
                self.capturer.capture(tensor, phase=phase, site=site, role=role, index=index,
                                      microbatch=microbatch, stage=stage, rows=rows,
                                      backward=backward, reduce=reduce, weight=weight,
                                      replicate=replicate)
            finally:
                if cap is not None:
                    cap.ops_paused -= 1

    def capture_segments(self, tensor: torch.Tensor, counts, rows, *, site: str,
                         phase: str = "fwd", role: str = "output",
                         microbatch: int | None = None, stage: int | None = None,
                         backward: bool = False) -> None:
        """Capture `tensor.split(counts)` as ragged pieces, segment e under index e.

        The shape of a grouped-experts computation: `tensor` holds every expert's rows one
        expert after the other, `counts[e]` of them for expert e, and `rows[e]` (from
        `agents.ragged.ragged_rows(counts, dp_group)`) places them in expert e's logical tensor.
        `backward`: also capture the gradient reaching `tensor`, split the same way (phase bwd,
        role grad_output).
        """
        if self.active:
            self.capturer._paused(self.capturer.capture_segments, tensor, counts, rows,
                                  phase=phase, site=site, role=role, microbatch=microbatch,
                                  stage=stage, backward=backward)

    def capture_state_dict(self, state_dict, *, step: int, stage: int = -1) -> None:
        """Digest a (nested) state dict as it is saved or loaded: phase ``state`` at `step`.

        Call it where the checkpoint is saved (``dcp.save(sd, ...)``) and where a resumed run
        has loaded it: each entry is keyed by the name DCP gives it on disk
        (``optim.state.layers.0.wq.weight.exp_avg``; agents/capture/state.py), DTensors by their
        shards, so the capture compares with the saved files (``auditor checkpoint``) and with
        another run's capture. Plain tensors on several dp ranks are replicas, as parameters
        are; name per-rank entries (an RNG state seeded per rank) in `shard_sites`
        (``"state:rng*"``). Captured whatever the step selection; never raises.
        """
        if not self.active:
            return
        try:
            from numaudit.agents.capture.state import flatten, leaf_tensor

            items = [(name, stage, leaf_tensor(value), None)
                     for name, value in flatten(state_dict)]
            with self.capturer.at_step(step):
                self.capturer.capture_values(items, phase="state")
        except Exception as exc:
            self.capturer._failed("capture_state_dict", exc)

    def capture_gradients(self) -> None:
        """Capture every watched parameter's gradient (None recorded explicitly) and, with phase
        param, its value now; inside a step block, in place of the capture at its exit."""
        if not self.active:
            return
        self._grads_taken = self._in_step
        for module, stage in self._models:
            self.capturer.capture_parameters(module, grads=True, stage=stage)
            self.capturer.capture_parameters(module, grads=False, stage=stage)

    def close(self, timeout: float | None = None, *, reason: str = "") -> dict:
        """Flush within `timeout` (default config.flush_timeout_s) + 1 s; returns the counts.

        Also called at interpreter exit and on SIGTERM for an agent not closed yet (`reason`
        says which): what is queued is delivered within the timeout or spilled to the spool.
        """
        return self._close(timeout, reason, from_watcher=False)

    def _close(self, timeout: float | None, reason: str, *, from_watcher: bool) -> dict:
        """close(); `from_watcher`: by agents/shutdown.py's SIGTERM watcher while the training
        thread is blocked, so the capturer (the training thread's) is left alone and the
        captures it had not handed over are counted as dropped (unsent_at_close)."""
        with self._close_lock:
            if self._closed:
                return self.summary()
            self._closed = True
            started = time.monotonic()
            try:
                if from_watcher:
                    self.counters.drop("unsent_at_close", self.capturer.unsent())
                else:
                    self.capturer.flush()
                    self.capturer.remove_hooks()
                    self.ops.remove_hooks()
                if self._optimizer_hook is not None:
                    self._optimizer_hook.remove()
                if self._sender is not None:
                    self._sender.close(self.config.flush_timeout_s if timeout is None
                                       else timeout)
            except Exception as exc:  # never into training
                log.warning("rank %d: numaudit close failed: %r", self.ident.rank, exc)
            shutdown.unregister(self)
            return self._report(started, reason)

    def _report(self, started: float, reason: str) -> dict:
        """The close's summary line (see close); returns the counts."""
        s = self.summary()
        if self.active:
            # At WARNING when anything did not reach the auditor, or the process is ending
            # without having closed the agent: where the records went is then news.
            level = logging.WARNING if s["spooled"] or s["dropped"] or reason else logging.INFO
            hint = self._sender.ingest_hint() if s["spooled"] and self._sender else ""
            where = f" in {s['spool']}" if s["spooled"] and s["spool"] else ""
            drops = ", ".join(f"{k} {v}" for k, v in sorted(s["dropped_by_reason"].items()))
            summary_logger().log(
                level, "rank %d: numaudit run=%s%s: captured %d: acked by the auditor %d, "
                "spooled %d%s, dropped %d%s; errors %d; conflicts %d; closed in %.2fs%s",
                self.ident.rank, s["run"], f" (at {reason})" if reason else "", s["captured"],
                s["acked"], s["spooled"], where, s["dropped"],
                f" ({drops})" if drops else "", s["errors"], s["conflicts"],
                time.monotonic() - started, f"; {hint}" if hint else "")
            if s["conflicts"]:
                log.error("rank %d: numaudit: %d records conflict with what run %s already "
                          "stored under the same key (a rerun or another job under this run "
                          "name?): `auditor show %s` lists them", self.ident.rank,
                          s["conflicts"], s["run"], s["run"])
        return s

    def backlog(self) -> Backlog:
        """Captured, acked and dropped record counts: cheaper than `summary`, for callers that
        pace themselves by the acks (`auditor checkpoint` keeps its memory bounded so)."""
        captured, _, dropped = self.counters.snapshot()
        snd = self._sender
        return Backlog(captured, snd.acked if snd else 0, sum(dropped.values()))

    def wait_for_acks(self, acked: int, timeout: float) -> None:
        """Blocks until the auditor has acked more than `acked` records or `timeout` seconds
        pass (at once without a connection to wait on). For the agent used as a library, off
        any training thread."""
        snd = self._sender
        delivery = snd.delivery if snd is not None else None
        if snd is None or delivery is None:
            return
        with delivery.progress:  # the same count as `backlog` (a sidecar's: only at close)
            delivery.progress.wait_for(lambda: snd.acked > acked, timeout)

    def summary(self) -> dict:
        captured, errors, dropped = self.counters.snapshot()
        snd = self._sender
        return {
            "captured": captured,
            "sent": snd.sent if snd else 0,
            "acked": snd.acked if snd else 0,
            "spooled": snd.spooled if snd else 0,
            "held_by_sidecar": snd.held_by_sidecar if snd else 0,
            "spool": snd.spool_path if snd else None,
            "dropped": sum(dropped.values()),
            "dropped_by_reason": dropped,
            "errors": errors,
            "not_captured": self.counters.not_captured_snapshot(),
            "reconnects": snd.reconnects if snd else 0,
            "conflicts": snd.conflicts if snd else 0,
            "run": snd.run if snd else self.config.run,
        }

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def attach(
    model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
    *,
    run: str | None = None,
    address: str | None = None,
    token: str | None = None,
    config: AgentConfig | None = None,
    mesh=None,
    dp_dim: str | None = None,
    dp_rank: int | None = None,
    dp_size: int | None = None,
    stages: Sequence[int] = (),
    dtype: str = "",
    seed: int = 0,
    labels: dict[str, str] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    **options,
) -> Agent:
    """Hook `model` (or each pipeline-stage module, with `stages` giving their indices), and
    `optimizer.step()` when an optimizer is given (`Agent.watch_optimizer`).

    Arguments set the configuration; NUMAUDIT_* variables override them (docs/agent.md). Raises
    ValueError for a configuration that cannot work — the one moment the agent may raise.
    """
    base = config or AgentConfig()
    overrides = {k: v for k, v in dict(run=run, address=address, token=token).items() if v}
    cfg = apply_env(_replace(base, **overrides, **options))
    check(cfg)
    ident = rank_identity(mesh, dp_dim=_given(dp_dim, cfg.dp_dim),
                          dp_dims=tuple(cfg.dp_dims) if cfg.dp_dims else None,
                          dp_rank=_given(dp_rank, cfg.dp_rank),
                          dp_size=_given(dp_size, cfg.dp_size), stages=tuple(stages))
    ident.dtype, ident.seed, ident.labels = dtype, seed, dict(labels or {})
    ident.grad_scale, ident.grad_scale_source = grad_scale(cfg, ident)
    note_capture_depth(ident, cfg)
    if cfg.enabled and cfg.run:
        ident.job_id, ident.job_id_source = job_identity(cfg.job_id)
    if cfg.sidecar and cfg.start_sidecar and cfg.enabled:
        ensure_sidecar(cfg, ident)
    agent = Agent(cfg, ident)
    modules = [] if model is None else ([model] if isinstance(model, torch.nn.Module)
                                        else list(model))
    stage_ids = list(stages) if stages else [-1] * len(modules)
    if len(stage_ids) != len(modules):
        raise ValueError(f"stages: {len(stage_ids)} indices for {len(modules)} stage modules")
    for module, stage in zip(modules, stage_ids):
        agent.watch(module, stage=stage)
    if optimizer is not None:
        agent.watch_optimizer(optimizer)
    return agent


def _given(value, default):
    """`value` unless it is None: 0 and "" are values (`x or default` would drop dp_rank=0)."""
    return default if value is None else value


def _replace(config: AgentConfig, **changes) -> AgentConfig:
    import dataclasses

    fields = {f.name for f in dataclasses.fields(AgentConfig)}
    unknown = set(changes) - fields
    if unknown:
        raise ValueError(f"unknown option(s): {', '.join(sorted(unknown))}")
    return dataclasses.replace(config, **changes)


SIDECAR_START_TIMEOUT_S = 20.0


def ensure_sidecar(cfg: AgentConfig, ident: RankIdentity) -> bool:
    """Local rank 0 starts the node's sidecar unless one listens; every rank waits for it.

    The sidecar runs in its own session (it outlives the job long enough to deliver, then exits
    when idle), so it can neither take the training process down nor be killed with its group.
    """
    import subprocess
    import sys
    from pathlib import Path

    from numaudit.agents.delivery.transport import wait_for_socket

    sidecar = cfg.sidecar
    if sidecar is None:  # asked only with a sidecar socket: none to wait for
        return False
    if wait_for_socket(sidecar, 0):
        return True
    if ident.local_rank == 0:
        spool = Path(cfg.spool_dir)
        spool.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "numaudit.agents.sidecar", "--listen", sidecar,
               "--spool", str(spool), "--exit-when-idle", "10"]
        if cfg.address:
            cmd += ["--auditor", cfg.address]
        env = dict(os.environ)  # the agent's own settings, whether arguments or environment
        for name, value in (("NUMAUDIT_TOKEN", cfg.token), ("NUMAUDIT_TLS_CA", cfg.tls_ca),
                            ("NUMAUDIT_TLS_CERT", cfg.tls_cert), ("NUMAUDIT_TLS_KEY", cfg.tls_key)):
            if value:
                env[name] = value
        with open(spool / "sidecar.log", "ab") as out:
            subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env=env)
    if wait_for_socket(sidecar, SIDECAR_START_TIMEOUT_S):
        return True
    log.warning("rank %d: no numaudit sidecar on %s after %.0fs; records will be spilled",
                ident.rank, cfg.sidecar, SIDECAR_START_TIMEOUT_S)
    return False
