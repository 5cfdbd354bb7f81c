"""Directives for agents (auditor/daemon/directives.py): bounded, validated, sent once per stream
(also while a stream waits for its next batch), and escalating needs its own token scope."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from numaudit.auditor.daemon.directives import DirectiveBoard, StreamDirectives
from numaudit.auditor.daemon.server import BackgroundServer
from numaudit.auditor.daemon.tokens import TokenFileError, Tokens
from numaudit.auditor.daemon.validate import ValidationError
from numaudit.protos import numaudit_pb2 as pb
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire import limits
from numaudit.wire.channels import open_channel

pytestmark = pytest.mark.timeout(60)


def test_the_board_validates_and_bounds_what_it_sends(monkeypatch):
    board = DirectiveBoard()
    with pytest.raises(ValidationError, match="run"):
        board.post("bad name", 1, ["m"], [])
    with pytest.raises(ValidationError, match="step"):
        board.post("ref", -1, ["m"], [])
    with pytest.raises(ValidationError, match="ops"):
        board.post("ref", 1, [], [])
    with pytest.raises(ValidationError, match=r"payload\[0\]"):
        board.post("ref", 1, ["m"], ["x" * (limits.MAX_DIRECTIVE_GLOB_CHARS + 1)])
    with pytest.raises(ValidationError, match="ops"):
        board.post("ref", 1, ["m"] * (limits.MAX_DIRECTIVE_GLOBS + 1), [])
    posted = [board.post("ref", s, ["m"], [], "r" * 5000)
              for s in range(limits.MAX_DIRECTIVES_PER_RUN + 3)]
    assert len(posted[0].reason) == limits.MAX_DIRECTIVE_REASON_CHARS
    assert len({d.id for d in posted}) == len(posted)
    kept = board.pending("ref", set())
    assert [d.step for d in kept] == list(range(3, limits.MAX_DIRECTIVES_PER_RUN + 3))
    assert board.pending("cand", set()) == [] and board.pending(None, set()) == []
    assert board.pending("ref", {kept[0].id}) == kept[1:]
    later = time.monotonic() + limits.DIRECTIVE_TTL_S + 1
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert board.pending("ref", set()) == []


def test_a_waiting_stream_sends_a_directive_at_once_and_each_only_once():
    async def scenario() -> list[pb.Ack]:
        board = DirectiveBoard()

        async def run_of(session: str) -> str:
            return {"s1": "ref"}[session]

        stream = StreamDirectives(board, run_of)
        assert not stream.listening()
        ack = pb.Ack(session_id="s1", acked_seq=3, stored=5)
        await stream.on_ack(ack)  # the first batch's Ack: the stream knows its session
        assert stream.listening() and not ack.directives
        nxt = asyncio.get_running_loop().create_future()  # the next batch, not yet here
        got = []

        async def consume() -> None:
            async for a in stream.while_waiting(nxt):
                got.append(a)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.01)
        board.arm()  # a watch escalates while the stream waits (an agent between steps)
        await asyncio.sleep(0.01)
        assert stream.run == "ref"
        board.post("ref", 7, ["layers.1.attention"], ["fwd:layers.1.attention"], "why")
        board.post("cand", 7, ["layers.1.attention"], [], "not this run's")
        await asyncio.sleep(0.01)
        nxt.set_result("batch")
        await task
        later = pb.Ack(session_id="s1", acked_seq=4)
        await stream.on_ack(later)  # already sent on this stream: not again
        assert not later.directives
        return got

    (ack,) = asyncio.run(scenario())
    assert (ack.session_id, ack.acked_seq, ack.stored) == ("s1", 3, 0)
    (d,) = ack.directives
    assert (d.step, list(d.ops), list(d.payload)) == (7, ["layers.1.attention"],
                                                      ["fwd:layers.1.attention"])


def test_escalating_needs_the_escalate_scope(tmp_path):
    secrets = {"reader": "tok-reader-only-5e7a9c1b3d6f", "esc": "tok-escalate-9b2d4f6a8c1e"}
    tokens = Tokens.parse({"token": [
        {"name": "reader", "token": secrets["reader"], "read": ["*"]},
        {"name": "esc", "token": secrets["esc"], "read": ["*"], "escalate": ["ref", "cand*"]},
    ]})
    with pytest.raises(TokenFileError, match="escalate"):
        Tokens.parse({"token": [{"name": "x", "token": "t" * 20, "escalate": "no spaces allowed"}]})
    with BackgroundServer("127.0.0.1:0", tmp_path / "s.db", tokens=tokens) as srv:
        def watch(who: str, escalate: bool, cand: str = "cand") -> tuple[str, str]:
            stub = numaudit_pb2_grpc.AuditorStub(open_channel(srv.address, token=secrets[who]))
            try:
                next(iter(stub.Watch(pb.WatchRequest(ref="ref", cand=cand, escalate=escalate),
                                     timeout=20)))
            except grpc.RpcError as exc:
                return exc.code().name, exc.details()
            return "OK", ""

        code, details = watch("reader", True)
        assert code == "PERMISSION_DENIED" and "escalate" in details, details
        assert watch("esc", True, cand="other")[0] == "PERMISSION_DENIED"
        # past the scope check, the runs do not exist yet
        assert watch("esc", True)[0] == "NOT_FOUND"
        assert watch("reader", False)[0] == "NOT_FOUND"


def test_a_run_whose_agents_take_no_directive_is_said_plainly():
    """Ranks behind the node sidecar (or NUMAUDIT_DIRECTIVES=0, an earlier agent) register
    without takes_directives: the escalating watch's status says escalation needs direct
    connections."""
    from numaudit.auditor.daemon.compare_service import _post

    async def scenario() -> list[pb.WatchEvent]:
        board = DirectiveBoard()
        board.note_register("ref", "s1", True)
        board.note_register("cand", "s2", False)
        board.note_register("cand", "s3", False)
        return _post(board, pb.WatchRequest(ref="ref", cand="cand", escalate=True),
                     [{"ops": ["m"], "payload": ["fwd:m"], "step": 3, "reason": "r"}])

    (event,) = asyncio.run(scenario())
    assert "ref: directive 1, 1 of 1 sessions take directives;" in event.status
    assert "cand: directive 2, 0 of 2 sessions take directives" in event.status
    assert "escalation needs direct connections" in event.status
    assert '"step": 3' in event.drill_json
