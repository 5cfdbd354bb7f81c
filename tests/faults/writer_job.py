""""The training process" of the fault tests: attaches an agent and captures N known records.

    python -m tests.faults.writer_job --out DIR --records N [--address HOST:PORT] [--rate R] ...

Record i has the key (step = i // per_step, microbatch 0, phase input, site "s{i % per_step}", role
value) and the tensor `arange(8) + i` (float32), so a test can re-derive every key it should find in
the store. Records carry no per-sample digests unless --sample-digests: they made each of these
8-element records ~4 times larger on the wire (~1.3 KB instead of ~320 bytes), and the tests' sizes
(a link's seconds at its rate, a memory budget, a tmpfs) are set for the small ones. The job writes,
under --out, as it goes (line-buffered, so a SIGKILL loses at most the line being written):

- batches.jsonl: every batch the sender cut: its seq and, per record, the key and the content hash
  the daemon will compute (`auditor.store.content_hash`) — the proof that a stored row is one this
  process produced;
- acks.jsonl: every ack that retired batches (monotonic time, acked seq, the seqs retired);
- fails.jsonl: every connection failure the delivery saw (status code name);
- progress: the number of records captured so far;
- report.json, at exit: the agent's summary and the timings the tests assert on.

Instrumentation wraps methods of this one agent's Sender/Delivery instance (`_cut`, `_ack`,
`_failed`): nothing in agents/ changes for the tests. If those names change, `instrument` fails
loudly at start-up (AttributeError), not silently.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

BASE_NUMEL = 8


def record_key(i: int, per_step: int) -> tuple[int, str]:
    """(step, site) of record i; the rest of the key is constant (mb 0, input, value, 0, 0)."""
    return i // per_step, f"s{i % per_step}"


def _open(path: Path):
    return open(path, "a", buffering=1)


def instrument(agent, out: Path) -> None:
    """Log every batch cut, every ack and every connection failure of `agent` under `out`."""
    import numaudit.agents.delivery.sender as sender_module
    from numaudit.protos import numaudit_pb2 as pb
    from numaudit.wire.batches import batch_columns
    from numaudit.wire.content_hash import content_hashes

    sender = agent._sender
    delivery = sender.delivery
    batches, acks, fails = (_open(out / n) for n in ("batches.jsonl", "acks.jsonl", "fails.jsonl"))
    cut, ack = sender._cut, (delivery._ack if delivery is not None else None)
    encode = sender_module.sealed_batch  # AttributeError here, at start-up, if it is renamed

    def logged_cut() -> None:
        # the batch as it goes on the wire: the bytes the cut encodes (sealed_batch's result)
        seq, built = sender._next_seq, []

        def keep(*args, **kwargs):
            built.append(encode(*args, **kwargs))
            return built[-1]

        sender_module.sealed_batch = keep
        try:
            cut()
        finally:
            sender_module.sealed_batch = encode
        if not built:
            return
        cols = batch_columns(pb.RecordBatch.FromString(built[0]))
        line = {"t": time.monotonic(), "n": cols.n}
        if sender._next_seq == seq + 1:
            line["seq"] = seq
            c = {k: v.tolist() for k, v in cols.cols.items()}
            line["k"] = [[c["step"][i], c["microbatch"][i], c["phase"][i], cols.sites[c["site"][i]],
                          c["role"][i], c["index"][i], c["call"][i]] for i in range(cols.n)]
            line["h"] = [h.hex() for h in content_hashes(cols)]
        else:
            line["dropped"] = True
        batches.write(json.dumps(line) + "\n")

    sender._cut = logged_cut
    if delivery is None:
        return

    def logged_ack(acked_seq: int) -> None:
        retired = [b.seq for b in delivery.pending if b.seq <= acked_seq]
        ack(acked_seq)
        if retired:
            acks.write(json.dumps({"t": time.monotonic(), "acked_seq": acked_seq,
                                   "seqs": retired}) + "\n")

    failed = delivery._failed

    def logged_failed(err, registering: bool = False) -> None:
        fails.write(json.dumps({"t": time.monotonic(), "code": err.code().name,
                                "details": (err.details() or "")[:200],
                                "registering": registering}) + "\n")
        failed(err, registering)

    delivery._ack = logged_ack
    delivery._failed = logged_failed


def _attach_dialing(start: int | None, **options):
    """`numaudit.attach(None, **options)`, its transport dialing replica `start` first instead of
    a random one: a test that needs agents on every replica places them. Fails loudly at start-up
    if the transport's start is no longer drawn by `random.randrange` into `_at`."""
    import numaudit
    import numaudit.agents.delivery.transport as transport_module

    if start is None:
        return numaudit.attach(None, **options)
    drawn = transport_module.random
    transport_module.random = type("Fixed", (), {"randrange": staticmethod(lambda n: start % n)})
    try:
        agent = numaudit.attach(None, **options)
    finally:
        transport_module.random = drawn
    transport = agent._sender.delivery.transport
    assert transport._at == start % len(transport._replicas), "the dial start was not placed"
    return agent


class _Items:
    """The DataLoader's dataset: item i is record i's tensor (made in a forked worker)."""

    def __init__(self, start: int, n: int) -> None:
        self.start, self.n = start, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, j: int):
        import torch

        i = self.start + j
        return i, torch.arange(BASE_NUMEL, dtype=torch.float32) + i


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--address", default=None)
    p.add_argument("--run", default="faults")
    p.add_argument("--records", type=int, required=True, help="most records captured")
    p.add_argument("--per-step", type=int, default=50)
    p.add_argument("--rate", type=float, default=0.0, help="records/s; 0 = as fast as possible")
    p.add_argument("--until-file", type=Path, default=None,
                   help="keep capturing (up to --records) until this file exists")
    p.add_argument("--spool", type=Path, default=None)
    p.add_argument("--spool-mode", default="spill")
    p.add_argument("--flush-timeout", type=float, default=10.0)
    p.add_argument("--connect-timeout", type=float, default=None)
    p.add_argument("--ack-timeout", type=float, default=None)
    p.add_argument("--sketch-k", type=int, default=16)
    p.add_argument("--batch-records", type=int, default=None)
    p.add_argument("--max-unacked-bytes", type=int, default=None)
    p.add_argument("--wait-first-ack", type=float, default=0.0,
                   help="after the first step, wait up to this long for an ack")
    p.add_argument("--dataloader-workers", type=int, default=0,
                   help="after the first ack, feed the rest through a forking DataLoader")
    p.add_argument("--no-close", action="store_true", help="exit without agent.close()")
    p.add_argument("--dial-start", type=int, default=None,
                   help="index of the replica in --address dialed first (default: a random one)")
    p.add_argument("--sample-digests", action="store_true",
                   help="per-sample digests of the records (off: the tests' sizes assume none)")
    args = p.parse_args(argv)

    import torch

    import numaudit

    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    # Warm-up: the first digest pays torch's lazy initialisation (~1 s here); step timings
    # below must measure the steady state, where a wait on the network would stand out.
    warm = numaudit.attach(None, run="warmup", spool_mode="off", sketch_k=args.sketch_k,
                         phases=("input",), sample_digests=args.sample_digests)
    with warm.step(0), warm.microbatch(0):
        warm.capture(torch.zeros(BASE_NUMEL), site="warmup", phase="input")
    warm.close(timeout=0.1)
    options = dict(sketch_k=args.sketch_k, spool_mode=args.spool_mode,
                   flush_timeout_s=args.flush_timeout, phases=("input",),
                   sample_digests=args.sample_digests)
    if args.spool is not None:
        options["spool_dir"] = str(args.spool)
    for name, value in (("connect_timeout_s", args.connect_timeout),
                        ("ack_timeout_s", args.ack_timeout),
                        ("batch_records", args.batch_records),
                        ("max_unacked_bytes", args.max_unacked_bytes)):
        if value is not None:
            options[name] = value
    agent = _attach_dialing(args.dial_start, run=args.run, address=args.address, **options)
    instrument(agent, args.out)
    progress = args.out / "progress"
    base = torch.arange(BASE_NUMEL, dtype=torch.float32)

    started = time.monotonic()
    max_step_s, captured, step_times = 0.0, 0, []
    loader_info: dict = {}

    def one_step(items) -> None:
        nonlocal max_step_s, captured
        t0 = time.monotonic()
        step = items[0][0] // args.per_step
        assert all(i // args.per_step == step for i, _ in items), "a batch spans two steps"
        with agent.step(step), agent.microbatch(0):
            for i, t in items:
                agent.capture(t, site=record_key(i, args.per_step)[1], phase="input")
        dt = time.monotonic() - t0
        step_times.append(dt)
        max_step_s = max(max_step_s, dt)
        captured += len(items)
        progress.write_text(f"{captured}\n")
        if args.rate:
            ahead = started + captured / args.rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)

    def stop_now() -> bool:
        return captured >= args.records or (
            args.until_file is not None and args.until_file.exists())

    i = 0
    while not stop_now() and not (args.dataloader_workers and i > 0):
        n = min(args.per_step, args.records - i)
        one_step([(i + j, base + (i + j)) for j in range(n)])
        i += n

    if args.dataloader_workers and not stop_now():
        deadline = time.monotonic() + max(args.wait_first_ack, 0.0)
        while agent.summary()["acked"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        loader_info["acked_before_fork"] = agent.summary()["acked"]
        t0 = time.monotonic()
        epochs = 3  # each epoch forks its workers again, at a different moment of the stream
        steps_left = -(-(args.records - i) // args.per_step)
        per_epoch = -(-steps_left // epochs) * args.per_step  # whole steps: keys stay unique
        for _ in range(epochs):
            loader = torch.utils.data.DataLoader(
                _Items(i, min(per_epoch, args.records - i)), batch_size=args.per_step,
                num_workers=args.dataloader_workers, multiprocessing_context="fork",
                collate_fn=lambda items: items)
            for items in loader:
                one_step(items)
                i += len(items)
        loader_info["loader_s"] = time.monotonic() - t0
        loader_info["forks"] = epochs * args.dataloader_workers

    capture_s = time.monotonic() - started
    if args.no_close:
        os._exit(0)
    t_close = time.monotonic()
    summary = agent.close()
    close_s = time.monotonic() - t_close
    report = dict(summary=summary, records=i, per_step=args.per_step, capture_s=capture_s,
                  max_step_s=max_step_s, median_step_s=sorted(step_times)[len(step_times) // 2]
                  if step_times else 0.0, close_s=close_s, t_close_start=t_close,
                  t_close_end=t_close + close_s, session_id=agent.session_id,
                  flush_timeout=args.flush_timeout, loader=loader_info, pid=os.getpid())
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
