"""Agent configuration: a dataclass of arguments, overridden field by field by NUMAUDIT_* variables.

Precedence, lowest first: the dataclass defaults < arguments to `agents.attach` < environment.
The environment wins so that an operator can redirect or switch off auditing of a job without
touching its code; a drill-down plan file sits between the arguments and the environment
(`apply_plan`). Every variable is named once here; docs/agent.md lists them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV_ADDR = "NUMAUDIT_ADDR"            # auditor address HOST:PORT
ENV_RUN = "NUMAUDIT_RUN"              # run name
ENV_TOKEN = "NUMAUDIT_TOKEN"          # bearer token (never logged)
ENV_TLS_CA = "NUMAUDIT_TLS_CA"        # PEM CA that signed the auditor's certificate: dial TLS
ENV_TLS_CERT = "NUMAUDIT_TLS_CERT"    # PEM client certificate (auditor requiring mutual TLS)
ENV_TLS_KEY = "NUMAUDIT_TLS_KEY"      # PEM key of the client certificate
ENV_DISABLE = "NUMAUDIT_DISABLE"      # "1": attach returns an agent that captures nothing
ENV_MODULES = "NUMAUDIT_MODULES"      # comma-separated globs of module sites to hook
ENV_EXCLUDE = "NUMAUDIT_EXCLUDE"      # comma-separated globs of module sites never hooked
ENV_DEPTH = "NUMAUDIT_DEPTH"          # deepest module level hooked (layers.0.moe is depth 3)
ENV_BLOCK_DEPTH = "NUMAUDIT_BLOCK_DEPTH"  # levels hooked inside each repeated block; 0 = none
ENV_PHASES = "NUMAUDIT_PHASES"        # comma-separated phases: fwd,bwd,grad,param,loss,input
ENV_STEPS = "NUMAUDIT_STEPS"          # steps captured: "0-3,10"; empty = all
ENV_STEP_EVERY = "NUMAUDIT_STEP_EVERY"  # capture only steps divisible by N; empty = every step
ENV_STEP_FIRST = "NUMAUDIT_STEP_FIRST"  # capture only steps numbered below K; empty = no limit
ENV_DIGEST = "NUMAUDIT_DIGEST"        # "auto" (fused kernel where it applies) | "eager"
ENV_RANKS = "NUMAUDIT_RANKS"          # ranks that capture: "0,4-7"; empty = all
ENV_PAYLOAD = "NUMAUDIT_PAYLOAD"      # comma-separated "phase:site" globs that carry raw payloads
ENV_SKETCH_K = "NUMAUDIT_SKETCH_K"    # CountSketch buckets
ENV_TRITON_ROWS = "NUMAUDIT_TRITON_ROWS"  # Triton digest: rows a program reads per step (tuning)
ENV_TRITON_WARPS = "NUMAUDIT_TRITON_WARPS"  # Triton digest: warps per program (tuning)
ENV_TRITON_FAST_LAUNCH = "NUMAUDIT_TRITON_FAST_LAUNCH"  # "0": every Triton launch through its JIT
ENV_SAMPLE_DIGESTS = "NUMAUDIT_SAMPLE_DIGESTS"  # "0": no per-sample digests of batch-holding
                                                # captures
ENV_FLUSH_TIMEOUT = "NUMAUDIT_FLUSH_TIMEOUT"  # seconds close() waits for acks
ENV_SIDECAR = "NUMAUDIT_SIDECAR"      # node sidecar socket, unix:///PATH (then no gRPC in-process)
ENV_SPOOL = "NUMAUDIT_SPOOL"          # spool directory
ENV_SPOOL_MODE = "NUMAUDIT_SPOOL_MODE"  # spill | always | off
ENV_PAYLOAD_MAX = "NUMAUDIT_PAYLOAD_MAX_BYTES"  # pieces up to this size carry a payload; 0 = off
ENV_REPLICATE = "NUMAUDIT_REPLICATE_SITES"  # "phase:site" globs of plain tensors that are replicas
ENV_SHARD = "NUMAUDIT_SHARD_SITES"    # "phase:site" globs of plain tensors that are not replicas
ENV_GRAD_SCALE = "NUMAUDIT_GRAD_SCALE"  # activation-gradient scale of this run
                                        # (docs/parallelisms.md)
ENV_LOSS_NORM = "NUMAUDIT_LOSS_NORMALIZATION"  # per_rank_mean | global_mean | sum
ENV_MICROBATCH_SIZE = "NUMAUDIT_MICROBATCH_SIZE"  # this rank's batch elements per microbatch
ENV_BATCH_DIM = "NUMAUDIT_BATCH_DIM"  # the dim the data-parallel split concatenates on
ENV_DP_DIMS = "NUMAUDIT_DP_DIMS"      # comma-separated mesh dims that split the batch
ENV_JOB_ID = "NUMAUDIT_JOB_ID"        # job id shared by the job's ranks (default: torchrun's)
ENV_RENAME = "NUMAUDIT_RENAME_IF_TAKEN"  # "1": a run name of another job becomes NAME.2, NAME.3...
ENV_OPS = "NUMAUDIT_OPS"              # module-site globs whose every operation is captured
ENV_PLAN = "NUMAUDIT_PLAN"            # drill-down plan file (`auditor drill -o`): ops, steps,
                                      # payload
ENV_DIRECTIVES = "NUMAUDIT_DIRECTIVES"  # "0": ignore the auditor's live directives
                                        # (watch --escalate)
SPOOL_MODES = ("spill", "always", "off")

PHASES = ("fwd", "bwd", "grad", "param", "loss", "input", "optim_grad", "update", "state")
REDUCTIONS = ("mean", "sum")
LOSS_NORMALIZATIONS = ("per_rank_mean", "global_mean", "sum")
"""How a rank's loss is normalized (docs/parallelisms.md): the mean over this rank's share of the
microbatch with gradients averaged over dp ranks (DDP/FSDP default); already divided by the whole
microbatch across dp ranks; or a sum over the rank's elements."""


@dataclass
class AgentConfig:
    """What the agent captures and where it sends it."""

    address: str | None = None
    """Auditor address HOST:PORT; None = no auditor (captures are counted and dropped)."""
    run: str | None = None
    """Run name, e.g. "ref" or "pp8"; required when an address is given."""
    token: str | None = None
    """Bearer token: call credentials over TLS, call metadata without (never logged)."""
    tls_ca: str | None = None
    """PEM CA file that signed the auditor's certificate; set = dial over TLS."""
    tls_cert: str | None = None
    """PEM client certificate file, for an auditor that requires mutual TLS (with tls_key)."""
    tls_key: str | None = None
    """PEM private key file of tls_cert."""
    sidecar: str | None = None
    """Node sidecar socket (unix:///PATH): records go there, and it talks to the auditor."""
    start_sidecar: bool = False
    """Local rank 0 starts the node's sidecar on `sidecar` if none is listening."""
    enabled: bool = True
    """False: attach() hooks nothing and every call is a no-op."""
    modules: tuple[str, ...] = ("*",)
    """Globs (fnmatch) on normalized module sites whose outputs are captured."""
    exclude: tuple[str, ...] = ()
    """Globs of module sites never captured, even when `modules` matches."""
    max_depth: int = 3
    """Deepest module level captured: `layers` is 1, `layers.0` 2, `layers.0.moe` 3."""
    block_depth: int = 1
    """Levels captured inside each repeated block (a child of a ModuleList or ModuleDict, such
    as a transformer block), wherever the block sits: 1 sees its attention, MLP and norms
    (`model.layers.0.self_attn` in transformers, below max_depth 3), 2 their projections too;
    0 = max_depth alone (agents/capture/sites.py)."""
    phases: tuple[str, ...] = ("fwd", "grad", "loss", "input")
    """Phases captured; add "bwd" for gradients at module outputs, "param" for weights."""
    steps: frozenset[int] | None = None
    """Steps captured; None = every step."""
    step_every: int | None = None
    """Capture only steps whose number is divisible by this; None = no such filter."""
    step_first: int | None = None
    """Capture only steps numbered below this (the first K when steps count from 0)."""
    ranks: frozenset[int] | None = None
    """Global ranks that capture; None = all. Other ranks attach as no-ops."""
    payload: tuple[str, ...] = ()
    """Globs on "phase:site" (e.g. "fwd:output") whose raw bytes travel zstd-compressed."""
    sketch_k: int = 256
    """CountSketch buckets per digest (a power of two); see docs/digests.md for the error band."""
    sample_digests: bool = True
    """Batch-holding captures (fwd, bwd, input) also carry a small digest per sample, so that
    runs grouping samples into other microbatches compare without payloads (docs/digests.md
    "Per-sample digests"; about 1-2 KiB more per record)."""
    dp_dim: str | None = None
    """Device-mesh dim along which the batch is split (activations are pieces of one tensor)."""
    dp_dims: tuple[str, ...] | None = None
    """Device-mesh dims that together split the batch (dp rank row-major over them, in mesh
    order), for meshes that name them otherwise; None = `dp_dim`, else recognized by name
    (`dp`, torchtitan's `batch`, `dp_replicate` x `dp_shard`, `fsdp`: agents/identity.py)."""
    dp_rank: int | None = None
    """Data-parallel rank, when no mesh dim is named; default: the global rank."""
    dp_size: int | None = None
    """Data-parallel size, when no mesh dim is named; default: the world size."""
    queue_records: int = 65536
    """Captures that may wait for the sender; past this they are dropped and counted."""
    max_unacked_bytes: int = 256 << 20
    """Memory budget for batches sent but not yet acked; past it new records are dropped."""
    batch_records: int = 512
    """Records per batch on the wire (FIELD-NOTES: gRPC pays per message)."""
    batch_interval_s: float = 0.05
    """A partial batch is sent after this long."""
    flush_timeout_s: float = 5.0
    """close() (also at exit and on SIGTERM) waits at most this long for acks, plus 1 s for the
    session close; what is still unacked then is spilled to the spool."""
    connect_timeout_s: float = 5.0
    """Deadline of each unary call (Register, CloseSession)."""
    ack_timeout_s: float = 10.0
    """A stream with unacked batches and no ack for this long is treated as hung and reopened."""
    device_batch: int = 64
    """Captures digested on the device before one host transfer."""
    digest: str = "auto"
    """"auto": the fused digest kernel where it applies (CPU tensors); "eager": the torch
    reference everywhere (agents/digest/fastpath.py)."""
    spool_dir: str = "numaudit-spool"
    """Where records the auditor did not take are written (`auditor ingest` replays them)."""
    spool_mode: str = "spill"
    """"spill": only what is unacked at close (or everything, without an address); "always":
    every batch is written ahead of sending (survives a killed training process); "off"."""
    payload_max_bytes: int = 16 << 10
    """Pieces of at most this many bytes carry their raw bytes (exact verdicts); 0 = only
    `payload`."""
    replicate_sites: tuple[str, ...] = ()
    """Globs on "phase:site" of plain tensors that are replicas over the non-dp mesh dims."""
    shard_sites: tuple[str, ...] = ()
    """Globs on "phase:site" of plain tensors that are not replicas (each rank's own values)."""
    grad_scale: float | None = None
    """Declared activation-gradient scale (docs/parallelisms.md); None = from loss_normalization."""
    loss_normalization: str | None = None
    """"per_rank_mean" | "global_mean" | "sum"; None = inferred ("per_rank_mean")."""
    microbatch_size: int | None = None
    """This rank's batch elements per microbatch: the weight of its mean reductions."""
    batch_dim: int = 0
    """The dim of activations and inputs that the data-parallel split concatenates ranks on:
    1 for sequence-first code ((seq, batch, ...) tensors). torch's RNNs, MultiheadAttention and
    Transformer modules say their own (`batch_first`; an RNN's hidden state: dim 1)."""
    job_id: str | None = None
    """The job's id, the same on every rank; default TORCHELASTIC_RUN_ID (docs/agent.md)."""
    rename_if_taken: bool = False
    """A run name registered by another job becomes NAME.2, NAME.3, ... instead of refused."""
    ops: tuple[str, ...] = ()
    """Globs on module sites inside whose forward and backward every operation's tensors are
    captured, on the selected steps (agents/capture/ops.py, docs/drill-down.md); none by default."""
    plan: str | None = None
    """A drill-down plan file written by `auditor drill -o` (TOML): its ops, steps and payload
    globs are taken as if given here (docs/drill-down.md)."""
    directives: bool = True
    """Act on the auditor's live directives (`auditor watch --escalate`): capture the operations
    of a flagged module at the step it names. False: they are ignored."""


def _split(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def parse_int_set(spec: str) -> frozenset[int] | None:
    """ "0-3,10" → {0,1,2,3,10}; "" → None (all). Raises ValueError naming the bad part."""
    spec = spec.strip()
    if not spec:
        return None
    out: set[int] = set()
    for part in _split(spec):
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"not an integer range: {part!r}") from None
        if b < a or a < 0:
            raise ValueError(f"bad range: {part!r}")
        out.update(range(a, b + 1))
    return frozenset(out)


def apply_env(config: AgentConfig, env: Mapping[str, str] | None = None) -> AgentConfig:
    """Return a copy of `config` with every NUMAUDIT_* variable that is set applied on top."""
    env = os.environ if env is None else env
    changes: dict = {}
    if env.get(ENV_ADDR):
        changes["address"] = env[ENV_ADDR]
    if env.get(ENV_RUN):
        changes["run"] = env[ENV_RUN]
    if env.get(ENV_TOKEN):
        changes["token"] = env[ENV_TOKEN]
    if env.get(ENV_SIDECAR):
        changes["sidecar"] = env[ENV_SIDECAR]
    for name, key in ((ENV_TLS_CA, "tls_ca"), (ENV_TLS_CERT, "tls_cert"), (ENV_TLS_KEY, "tls_key")):
        if env.get(name):
            changes[key] = env[name]
    if env.get(ENV_DISABLE, "").strip() in ("1", "true", "yes"):
        changes["enabled"] = False
    if ENV_MODULES in env:
        changes["modules"] = _split(env[ENV_MODULES])
    if ENV_EXCLUDE in env:
        changes["exclude"] = _split(env[ENV_EXCLUDE])
    if env.get(ENV_DEPTH):
        changes["max_depth"] = int(env[ENV_DEPTH])
    if env.get(ENV_BLOCK_DEPTH):
        changes["block_depth"] = int(env[ENV_BLOCK_DEPTH])
    if ENV_PHASES in env:
        changes["phases"] = _split(env[ENV_PHASES])
    if ENV_STEPS in env:
        changes["steps"] = parse_int_set(env[ENV_STEPS])
    for name, key in ((ENV_STEP_EVERY, "step_every"), (ENV_STEP_FIRST, "step_first")):
        if name in env:
            changes[key] = int(env[name]) if env[name].strip() else None
    if env.get(ENV_DIGEST):
        changes["digest"] = env[ENV_DIGEST].strip()
    if ENV_RANKS in env:
        changes["ranks"] = parse_int_set(env[ENV_RANKS])
    if ENV_PAYLOAD in env:
        changes["payload"] = _split(env[ENV_PAYLOAD])
    if env.get(ENV_SKETCH_K):
        changes["sketch_k"] = int(env[ENV_SKETCH_K])
    if env.get(ENV_SAMPLE_DIGESTS):
        changes["sample_digests"] = env[ENV_SAMPLE_DIGESTS].strip() not in ("0", "false", "no")
    if env.get(ENV_SPOOL):
        changes["spool_dir"] = env[ENV_SPOOL]
    if env.get(ENV_SPOOL_MODE):
        changes["spool_mode"] = env[ENV_SPOOL_MODE].strip()
    if env.get(ENV_FLUSH_TIMEOUT):
        changes["flush_timeout_s"] = float(env[ENV_FLUSH_TIMEOUT])
    if env.get(ENV_PAYLOAD_MAX):
        changes["payload_max_bytes"] = int(env[ENV_PAYLOAD_MAX])
    if ENV_REPLICATE in env:
        changes["replicate_sites"] = _split(env[ENV_REPLICATE])
    if ENV_SHARD in env:
        changes["shard_sites"] = _split(env[ENV_SHARD])
    if env.get(ENV_GRAD_SCALE):
        changes["grad_scale"] = float(env[ENV_GRAD_SCALE])
    if env.get(ENV_LOSS_NORM):
        changes["loss_normalization"] = env[ENV_LOSS_NORM].strip()
    if env.get(ENV_MICROBATCH_SIZE):
        changes["microbatch_size"] = int(env[ENV_MICROBATCH_SIZE])
    if env.get(ENV_BATCH_DIM):
        changes["batch_dim"] = int(env[ENV_BATCH_DIM])
    if ENV_DP_DIMS in env:
        changes["dp_dims"] = _split(env[ENV_DP_DIMS]) or None
    if env.get(ENV_JOB_ID):
        changes["job_id"] = env[ENV_JOB_ID].strip()
    if ENV_RENAME in env:
        changes["rename_if_taken"] = env[ENV_RENAME].strip() in ("1", "true", "yes")
    if ENV_OPS in env:
        changes["ops"] = _split(env[ENV_OPS])
    if ENV_DIRECTIVES in env:
        changes["directives"] = env[ENV_DIRECTIVES].strip() not in ("0", "false", "no")
    if env.get(ENV_PLAN):
        changes["plan"] = env[ENV_PLAN]
    out = dataclasses.replace(config, **changes)
    if out.plan:  # between the arguments and the variables
        out = apply_plan(out, out.plan, explicit=set(changes))
    return out


def apply_plan(config: AgentConfig, path: str, *, explicit: set[str]) -> AgentConfig:
    """`config` with the drill-down plan at `path` applied (`NUMAUDIT_PLAN`, `attach(plan=)`);
    `explicit`: fields the environment set (they win). ValueError naming the file and field for
    a plan that cannot be read.

    The plan's settings sit between the arguments and the environment: its `ops` and `steps`
    replace the arguments' unless a NUMAUDIT_* variable sets them, and its `payload` globs are
    added to whatever payload globs are set (raw bytes of the drilled module's outputs come on
    top of what the run already sends). The format is `wire.plan`'s, the one the auditor
    writes.
    """
    from numaudit.wire.plan import read_plan

    plan = read_plan(path)
    changes: dict = {}
    if "ops" not in explicit:
        changes["ops"] = plan.ops
    if "steps" not in explicit:
        changes["steps"] = frozenset(plan.steps) if plan.steps else None
    changes["payload"] = tuple(dict.fromkeys((*config.payload, *plan.payload)))
    return dataclasses.replace(config, **changes)


def check(config: AgentConfig) -> None:
    """Raise ValueError naming the field when the configuration cannot work."""
    unknown = set(config.phases) - set(PHASES)
    if unknown:
        raise ValueError(f"phases: unknown {sorted(unknown)}; known: {', '.join(PHASES)}")
    k = config.sketch_k
    if k < 1 or k & (k - 1):
        raise ValueError(f"sketch_k: {k} is not a power of two")
    from numaudit.wire.limits import MAX_SKETCH_BUCKETS

    if k > MAX_SKETCH_BUCKETS:  # the auditor refuses such records (docs/protocol.md)
        raise ValueError(f"sketch_k: {k} is over the protocol's {MAX_SKETCH_BUCKETS} buckets")
    if (config.address or config.sidecar) and not config.run:
        raise ValueError(f"run: required with an address (argument run= or {ENV_RUN})")
    if config.run:  # the auditor's rule; spool file names are built from it
        from numaudit.wire.names import check_run_name

        check_run_name(config.run)
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ValueError("tls_cert/tls_key: a client certificate needs its key, and a key its "
                         f"certificate ({ENV_TLS_CERT}, {ENV_TLS_KEY})")
    for key in ("tls_ca", "tls_cert", "tls_key"):
        path = getattr(config, key)
        if path and not os.access(path, os.R_OK):
            raise ValueError(f"{key}: cannot read {path}")
    if config.spool_mode not in SPOOL_MODES:
        raise ValueError(f"spool_mode: {config.spool_mode!r} is not one of "
                         f"{', '.join(SPOOL_MODES)}")
    if config.step_every is not None and config.step_every < 1:
        raise ValueError(f"step_every: {config.step_every} < 1 ({ENV_STEP_EVERY})")
    if config.step_first is not None and config.step_first < 0:
        raise ValueError(f"step_first: {config.step_first} < 0 ({ENV_STEP_FIRST})")
    if config.digest not in ("auto", "eager"):
        raise ValueError(f"digest: {config.digest!r} is not auto or eager ({ENV_DIGEST})")
    if config.max_depth < 1:
        raise ValueError("max_depth: must be >= 1")
    if config.block_depth < 0:
        raise ValueError(f"block_depth: {config.block_depth} < 0 (0 = max_depth alone)")
    if config.dp_dims is not None and (isinstance(config.dp_dims, str) or not all(
            isinstance(d, str) and d for d in config.dp_dims)):
        raise ValueError(f"dp_dims: {config.dp_dims!r} is not a tuple of mesh dim names")
    if config.batch_records < 1 or config.queue_records < 1:
        raise ValueError("batch_records/queue_records: must be >= 1")
    if config.payload_max_bytes < 0:
        raise ValueError(f"payload_max_bytes: {config.payload_max_bytes} is negative (0 = off)")
    if config.grad_scale is not None and not (math.isfinite(config.grad_scale)
                                              and config.grad_scale > 0):
        raise ValueError(f"grad_scale: {config.grad_scale} is not a finite number > 0")
    if (config.loss_normalization is not None
            and config.loss_normalization not in LOSS_NORMALIZATIONS):
        raise ValueError(f"loss_normalization: {config.loss_normalization!r} is not one of "
                         f"{', '.join(LOSS_NORMALIZATIONS)}")
    if config.microbatch_size is not None and config.microbatch_size < 1:
        raise ValueError(f"microbatch_size: {config.microbatch_size} < 1")
    if not 0 <= config.batch_dim < 64:
        raise ValueError(f"batch_dim: {config.batch_dim} is not in [0, 64)")
    if isinstance(config.ops, str) or not all(isinstance(g, str) and g for g in config.ops):
        raise ValueError(f"ops: {config.ops!r} is not a tuple of module-site globs ({ENV_OPS})")


def step_selected(config: AgentConfig, step: int) -> bool:
    """Whether `step` is captured: a pure function of the step number and the settings, so two
    runs with the same settings capture the same steps (all filters must agree)."""
    if config.steps is not None and step not in config.steps:
        return False
    if config.step_every is not None and step % config.step_every:
        return False
    return config.step_first is None or step < config.step_first
