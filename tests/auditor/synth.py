"""Synthetic runs written through the real ingest path, for the comparison tests.

Tensors are real torch tensors; pieces are digested by the agent's own code
(`agents.digest.digest.digest_piece`) with the agent's layouts (`agents.layout.PieceLayout`),
wrapped in protobuf records, validated as the daemon does, and stored by `StoreWriter` +
`Store.ingest` into a real SQLite file or PostgreSQL database (`open_writer`).
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zstandard

from numaudit.agents.digest.digest import digest_piece
from numaudit.agents.layout import PieceLayout
from numaudit.auditor.compare.digests.algebra import DigestValues
from numaudit.auditor.daemon.validate import validate_batch
from numaudit.auditor.store.backend import open_writer
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import limits

PHASES = {"fwd": pb.PHASE_FWD, "bwd": pb.PHASE_BWD, "grad": pb.PHASE_GRAD,
          "param": pb.PHASE_PARAM, "loss": pb.PHASE_LOSS, "input": pb.PHASE_INPUT}
ROLES = {"output": pb.ROLE_OUTPUT, "input": pb.ROLE_INPUT, "grad_output": pb.ROLE_GRAD_OUTPUT,
         "grad_input": pb.ROLE_GRAD_INPUT, "value": pb.ROLE_VALUE}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float64: "float64", torch.int64: "int64", torch.int32: "int32",
                torch.bool: "bool"}
_session_ids = itertools.count()


def piece_record(t: torch.Tensor, layout: PieceLayout, *, step: int, microbatch: int,
                 phase: str, site: str, role: str = "output", index: int = 0, call: int = 0,
                 stage: int = -1, payload: bool = False, sketch_k: int = 64) -> pb.Record:
    """One record of a piece, digested by the agent's code."""
    f64, i64 = digest_piece(t, layout, sketch_k=sketch_k)
    has_moments = t.dtype.is_floating_point or t.dtype.is_complex
    d = DigestValues.from_rows(f64.tolist(), i64.tolist(), has_moments)
    rec = pb.Record(key=pb.Key(step=step, microbatch=microbatch, phase=PHASES[phase], site=site,
                               role=ROLES[role], index=index, call=call), stage=stage)
    layout.to_proto(rec.layout, dtype=_DTYPE_NAMES[t.dtype])
    d.to_proto(rec.digest)
    if payload:
        raw = t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.dim() else \
            t.detach().reshape(1).view(torch.uint8).numpy().tobytes()
        data = zstandard.ZstdCompressor(level=1).compress(raw)
        rec.payload.CopyFrom(pb.Payload(codec="zstd", raw_nbytes=len(raw),
                                        compressed_nbytes=len(data), crc32=zlib.crc32(data),
                                        chunk_index=0, chunk_count=1, data=data))
    return rec


def none_record(*, step: int, site: str, phase: str = "grad", microbatch: int = -1,
                role: str = "value", stage: int = -1) -> pb.Record:
    return pb.Record(key=pb.Key(step=step, microbatch=microbatch, phase=PHASES[phase], site=site,
                                role=ROLES[role]), stage=stage, is_none=True)


def shards(t: torch.Tensor, n: int, dim: int = 0, *, replica: bool = False
           ) -> list[tuple[torch.Tensor, PieceLayout]]:
    """Split t into n contiguous pieces along dim (uneven allowed), with their layouts."""
    out = []
    size = t.shape[dim]
    bounds = [round(i * size / n) for i in range(n + 1)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        piece = t.narrow(dim, a, b - a)
        offsets = [0] * t.dim()
        offsets[dim] = a
        out.append((piece, PieceLayout(tuple(t.shape), tuple(offsets), tuple(piece.shape),
                                       replica=replica)))
    return out


@dataclass
class RunBuilder:
    """Records per rank of one synthetic run; `write` stores them through the ingest path."""

    name: str
    world_size: int = 1
    dtype: str = "float32"
    stages: dict[int, list[int]] = field(default_factory=dict)
    sketch_k: int = 64
    close: bool = True
    records: dict[int, list[pb.Record]] = field(default_factory=dict)
    register: dict = field(default_factory=dict)
    """Extra RegisterRequest fields for every rank (grad_scale, mesh_shape, ...)."""
    mesh: dict[int, list[int]] = field(default_factory=dict)
    """Mesh coordinate per rank."""
    numbered: bool = True
    """Records carry their capture order (each rank's records numbered 1, 2, ... in the order
    they are added, as an agent numbers its captures); False: as an earlier build's agent sent
    them (0, not numbered)."""

    def _append(self, rank: int, rec: pb.Record) -> None:
        recs = self.records.setdefault(rank, [])
        rec.capture_order = len(recs) + 1 if self.numbered else 0
        recs.append(rec)

    def add(self, rank: int, t: torch.Tensor, layout: PieceLayout | None = None, **key) -> None:
        layout = layout or PieceLayout.full(tuple(t.shape))
        self._append(rank, piece_record(t, layout, sketch_k=self.sketch_k, **key))

    def add_full(self, t: torch.Tensor, *, ranks: Sequence[int] | None = None, **key) -> None:
        """The whole tensor on one rank (rank 0), or replicated on several ranks."""
        ranks = list(ranks or [0])
        for r in ranks:
            lay = PieceLayout.full(tuple(t.shape))
            if len(ranks) > 1:
                lay = PieceLayout(lay.logical_shape, lay.offsets, lay.shape, replica=True)
            self.add(r, t, lay, **key)

    def add_sharded(self, t: torch.Tensor, ranks: Sequence[int], dim: int = 0, **key) -> None:
        for r, (piece, lay) in zip(ranks, shards(t, len(ranks), dim)):
            self.add(r, piece, lay, **key)

    def add_none(self, rank: int, **key) -> None:
        self._append(rank, none_record(**key))

    def write(self, db: Path, *, batch_size: int = 512) -> None:
        writer = open_writer(db, synchronous="NORMAL")
        try:
            for rank in range(self.world_size):
                sid = f"{self.name}-{rank}-{next(_session_ids)}"
                req = pb.RegisterRequest(
                    schema_version=limits.CURRENT_SCHEMA_VERSION, run=self.name, session_id=sid,
                    rank=rank, world_size=self.world_size, stages=self.stages.get(rank, []),
                    torch_version=torch.__version__, dtype=self.dtype, host="synth",
                    local_rank=rank, mesh_coordinate=self.mesh.get(rank, []), **self.register)
                writer.submit(lambda s, r=req: s.register(r)).result()
                recs = self.records.get(rank, [])
                for seq, start in enumerate(range(0, len(recs), batch_size), start=1):
                    batch = pb.RecordBatch(schema_version=limits.CURRENT_SCHEMA_VERSION,
                                           session_id=sid, seq=seq,
                                           records=recs[start:start + batch_size])
                    validate_batch(batch)
                    writer.submit(lambda s, b=batch: s.ingest(b)).result()
                if self.close:
                    close = pb.CloseSessionRequest(
                        schema_version=limits.CURRENT_SCHEMA_VERSION, session_id=sid,
                        records_sent=len(recs))
                    writer.submit(lambda s, c=close: s.close_session(c)).result()
        finally:
            writer.close()


def write_runs(db: Path, *runs: RunBuilder) -> Path:
    for r in runs:
        r.write(db)
    return db


def mlp_run(name: str, *, steps: int = 1, microbatches: int = 2, world: int = 1,
            layers: int = 3, width: int = 8, batch: int = 8, seed: int = 0, perturb=None,
            payload: bool = False, dp_shard: bool = True) -> RunBuilder:
    """A small model's captures: input, per-layer fwd outputs, loss, bwd, grads and params.

    ``perturb(kind, step, mb, site, tensor) -> tensor`` may change any tensor before digesting.
    With ``world > 1`` activations are split on the batch dim across ranks (data parallel) and
    parameters/gradients are sharded on dim 0 (FSDP-style), so a world-1 and a world-4 run of
    the same tensors must be identical.
    """
    g = torch.Generator().manual_seed(seed)
    b = RunBuilder(name, world_size=world)
    ranks = list(range(world))
    perturb = perturb or (lambda kind, step, mb, site, t: t)
    weights = {f"layers.{i}.weight": torch.randn(width, width, generator=g) for i in range(layers)}
    for step in range(steps):
        for site, w in weights.items():
            w = perturb("param", step, -1, site, w)
            _put(b, w, ranks, dp_shard, step=step, microbatch=-1, phase="param", site=site,
                 role="value", payload=payload)
        for mb in range(microbatches):
            x = perturb("input", step, mb, "input", torch.randn(batch, width, generator=g))
            _put(b, x, ranks, True, step=step, microbatch=mb, phase="input", site="input",
                 role="value", payload=payload)
            h = x
            for i in range(layers):
                h = torch.tanh(h @ weights[f"layers.{i}.weight"])
                h = perturb("fwd", step, mb, f"layers.{i}", h)
                _put(b, h, ranks, True, step=step, microbatch=mb, phase="fwd",
                     site=f"layers.{i}", role="output", payload=payload)
            loss = perturb("loss", step, mb, "loss", (h ** 2).mean().reshape(()))
            b.add_full(loss, step=step, microbatch=mb, phase="loss", site="loss",
                       role="value", payload=payload)
            for i in reversed(range(layers)):
                gh = perturb("bwd", step, mb, f"layers.{i}", torch.randn(h.shape, generator=g))
                _put(b, gh, ranks, True, step=step, microbatch=mb, phase="bwd",
                     site=f"layers.{i}", role="grad_output", payload=payload)
        for site, w in weights.items():
            gw = perturb("grad", step, -1, site, torch.randn(w.shape, generator=g))
            if gw is None:
                for r in ranks:
                    b.add_none(r, step=step, site=site)
                continue
            _put(b, gw, ranks, dp_shard, step=step, microbatch=-1, phase="grad", site=site,
                 role="value", payload=payload)
    return b


def _put(b: RunBuilder, t: torch.Tensor, ranks: list[int], shard: bool, **key) -> None:
    if len(ranks) > 1 and shard:
        b.add_sharded(t, ranks, **key)
    else:
        b.add_full(t, **key)


def one_ulp(t: torch.Tensor, flat_index: int = 0) -> torch.Tensor:
    """t with one element moved to the next representable float32 value."""
    out = t.clone()
    flat = out.view(-1)
    flat[flat_index] = torch.nextafter(flat[flat_index], torch.tensor(float("inf")))
    return out


def iter_batches(records: Iterable[pb.Record], size: int) -> Iterable[list[pb.Record]]:
    buf: list[pb.Record] = []
    for r in records:
        buf.append(r)
        if len(buf) >= size:
            yield buf
            buf = []
    if buf:
        yield buf


def send(stub, run: RunBuilder, *, batch_size: int = 256, timeout: float = 30.0) -> None:
    """Store a synthetic run through a running daemon: Register, Ingest, CloseSession RPCs."""
    for rank in range(run.world_size):
        sid = f"{run.name}-{rank}-{next(_session_ids)}"
        stub.Register(pb.RegisterRequest(
            schema_version=limits.CURRENT_SCHEMA_VERSION, run=run.name, session_id=sid,
            rank=rank, world_size=run.world_size, stages=run.stages.get(rank, []),
            torch_version=torch.__version__, dtype=run.dtype, host="synth", local_rank=rank),
            timeout=timeout)
        recs = run.records.get(rank, [])
        batches = [pb.RecordBatch(schema_version=limits.CURRENT_SCHEMA_VERSION, session_id=sid,
                                  seq=seq, records=recs[start:start + batch_size])
                   for seq, start in enumerate(range(0, len(recs), batch_size), start=1)]
        acks = list(stub.Ingest(iter(batches), timeout=timeout))
        assert len(acks) == len(batches)
        if run.close:
            stub.CloseSession(pb.CloseSessionRequest(
                schema_version=limits.CURRENT_SCHEMA_VERSION, session_id=sid,
                records_sent=len(recs)), timeout=timeout)
