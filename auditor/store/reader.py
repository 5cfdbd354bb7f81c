"""Read side of the store: runs, sessions, records and payloads, for the daemon and the comparison.

Any number of readers, each with its own read-only connection (WAL lets them read while the single
writer commits). The comparison reads the records table directly as columns
(`auditor.compare.read.columns`); this class is everything else.

A store location is a SQLite path or a ``postgresql://`` URL (`auditor.store.backend`); on
PostgreSQL `conn` is a `postgres.QmarkConnection` in autocommit (each query sees what is
committed), which runs this module's SQLite-style SQL unchanged. `dialect` says which.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from numaudit.auditor.store.dbapi import SqlConnection
from numaudit.auditor.store.errors import UnknownRun, UnknownSession
from numaudit.auditor.store.location import is_postgres_url
from numaudit.auditor.store.sqlite import connect


class Reader:
    """Read side of the store; safe to use from any thread with its own instance."""

    def __init__(self, path: str | Path) -> None:
        self.conn: SqlConnection
        if is_postgres_url(path):
            from numaudit.auditor.store.postgres import QmarkConnection, pg_connect

            self.dialect = "postgres"
            self.conn = QmarkConnection(pg_connect(str(path), readonly=True))
            return
        if not Path(path).exists():
            raise FileNotFoundError(f"no store at {path}")
        self.dialect = "sqlite"
        self.conn = connect(path, readonly=True)  # NotAStore for anything but a numaudit store

    def close(self) -> None:
        self.conn.close()

    def run_id(self, name: str) -> int:
        row = self.conn.execute("SELECT run_id FROM runs WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise UnknownRun(f"run: no run named {name!r} in the store")
        return row[0]

    def session_run(self, session_id: str) -> str:
        """The name of the run a session belongs to; UnknownSession if none."""
        row = self.conn.execute(
            "SELECT r.name FROM sessions s JOIN runs r ON r.run_id = s.run_id"
            " WHERE s.session_id = ?", (session_id,)
        ).fetchone()
        if row is None:
            raise UnknownSession(f"session_id: {session_id!r} is not registered")
        return row[0]

    def run_names(self) -> list[str]:
        return [r[0] for r in self.conn.execute("SELECT name FROM runs ORDER BY created")]

    def run_info(self, name: str) -> dict:
        """Run-level metadata as registered by its first rank."""
        row = self.conn.execute(
            "SELECT run_id, name, created, world_size, mesh_shape, mesh_dim_names, torch_version,"
            " dtype, seed, labels FROM runs WHERE name = ?", (name,)
        ).fetchone()
        if row is None:
            raise UnknownRun(f"run: no run named {name!r} in the store")
        keys = ("run_id", "name", "created", "world_size", "mesh_shape", "mesh_dim_names",
                "torch_version", "dtype", "seed", "labels")
        info = dict(zip(keys, row))
        for k in ("mesh_shape", "mesh_dim_names", "labels"):
            info[k] = json.loads(info[k])
        info["job_id"] = self.conn.execute("SELECT job_id FROM runs WHERE run_id = ?",
                                           (info["run_id"],)).fetchone()[0]
        scales = self.conn.execute(
            "SELECT DISTINCT grad_scale, grad_scale_source FROM sessions WHERE run_id = ?"
            " ORDER BY grad_scale", (info["run_id"],)).fetchall()
        values = sorted({g for g, _ in scales})
        # activation-gradient scale of the run (0 = undeclared, taken as 1); None when its
        # sessions disagree (the comparison says so and does not rescale)
        info["grad_scale"] = (values[0] or 1.0) if len(values) == 1 else None
        info["grad_scale_sources"] = sorted({src for _, src in scales if src})
        info["grad_scale_declared"] = bool(values) and all(g > 0 for g in values)
        return info

    def sessions(self, run: str) -> list[dict]:
        run_id = self.run_id(run)
        cur = self.conn.execute(
            "SELECT s.session_id, s.rank, s.local_rank, s.host, s.mesh_coordinate, s.stages,"
            " s.registered, s.acked_seq, s.closed, s.records_sent, s.records_dropped,"
            " s.capture_errors, s.dropped_by_reason,"
            " (SELECT COUNT(*) FROM records r WHERE r.session_id = s.session_id), s.agent_version"
            " FROM sessions s WHERE s.run_id = ? ORDER BY s.rank, s.registered", (run_id,)
        )
        keys = ("session_id", "rank", "local_rank", "host", "mesh_coordinate", "stages",
                "registered", "acked_seq", "closed", "records_sent", "records_dropped",
                "capture_errors", "dropped_by_reason", "records_stored", "agent_version")
        out = []
        for row in cur:
            s = dict(zip(keys, row))
            s["mesh_coordinate"] = json.loads(s["mesh_coordinate"])
            s["stages"] = json.loads(s["stages"])
            s["dropped_by_reason"] = json.loads(s["dropped_by_reason"] or "{}")
            out.append(s)
        return out

    def records(self, run: str, *, phase: int | None = None) -> Iterator[tuple]:
        """Every record of a run as a tuple in RECORD_COLUMNS order, sorted by key then rank."""
        run_id = self.run_id(run)
        where = "r.run_id = ?" + (" AND r.phase = ?" if phase is not None else "")
        params: tuple = (run_id,) if phase is None else (run_id, phase)
        return self.conn.execute(
            "SELECT r.step, r.microbatch, r.phase, s.name, r.role, r.idx, r.call, r.rank, r.stage,"
            " r.is_none, r.dtype, r.logical_shape, r.offsets, r.shape, r.replica, r.partial,"
            " r.complex_as_real, r.numel, r.nan, r.posinf, r.neginf, r.zeros, r.has_moments,"
            " r.sum, r.sum_sq, r.min, r.max, r.abs_max, r.fingerprint, r.sketch, r.record_id,"
            " EXISTS (SELECT 1 FROM payload_chunks p WHERE p.record_id = r.record_id),"
            " r.reduce, r.reduce_weight, r.reduce_index, r.reduce_count,"
            " r.ragged_parts, r.ragged_first, r.ragged_span, r.flat, r.capture_order"
            f" FROM records r JOIN sites s ON s.site_id = r.site_id WHERE {where}"
            " ORDER BY r.step, r.microbatch, r.phase, r.site_id, r.role, r.idx, r.call, r.rank",
            params,
        )

    def payload(self, record_id: int) -> tuple[dict, bytes] | None:
        """(header, compressed bytes) of a record's payload, or None if absent or incomplete."""
        rows = self.conn.execute(
            "SELECT chunk_index, chunk_count, codec, raw_nbytes, compressed_nbytes, crc32, data"
            " FROM payload_chunks WHERE record_id = ? ORDER BY chunk_index", (record_id,)
        ).fetchall()
        if not rows or len(rows) != rows[0][1]:
            return None
        data = b"".join(r[6] for r in rows)
        header = dict(codec=rows[0][2], raw_nbytes=rows[0][3], compressed_nbytes=rows[0][4],
                      crc32=rows[0][5])
        return header, data

    def conflicts(self, run: str) -> int:
        run_id = self.run_id(run)
        return self.conn.execute(
            "SELECT COUNT(*) FROM conflicts c JOIN records r ON r.record_id = c.record_id"
            " WHERE r.run_id = ?", (run_id,)
        ).fetchone()[0]

    def phase_counts(self, run: str) -> list[tuple[int, int, int, int]]:
        """(phase, distinct sites, records, none records) per phase."""
        run_id = self.run_id(run)
        return [(int(p), int(s), int(n), int(none or 0)) for p, s, n, none in self.conn.execute(
            "SELECT phase, COUNT(DISTINCT site_id), COUNT(*), SUM(is_none) FROM records"
            " WHERE run_id = ? GROUP BY phase ORDER BY phase", (run_id,)
        ).fetchall()]

    def steps(self, run: str) -> list[int]:
        run_id = self.run_id(run)
        return [r[0] for r in self.conn.execute(
            "SELECT DISTINCT step FROM records WHERE run_id = ? ORDER BY step", (run_id,))]

    def microbatch_count(self, run: str) -> int:
        run_id = self.run_id(run)
        return self.conn.execute(
            "SELECT COUNT(DISTINCT microbatch) FROM records WHERE run_id = ? AND microbatch >= 0",
            (run_id,)).fetchone()[0]

    def none_grad_sites(self, run: str) -> list[str]:
        run_id = self.run_id(run)
        return [r[0] for r in self.conn.execute(
            "SELECT DISTINCT s.name FROM records r JOIN sites s ON s.site_id = r.site_id"
            " WHERE r.run_id = ? AND r.is_none = 1 ORDER BY s.name", (run_id,))]
