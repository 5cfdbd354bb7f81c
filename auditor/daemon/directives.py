"""Directives to agents, delivered on the Ingest streams they already hold (docs/protocol.md
"Directives", docs/drill-down.md).

`auditor watch --escalate` flags a module while both runs are still going; the watch posts a
directive for each run on the daemon's `DirectiveBoard` ("capture the operations of
layers.1.attention, and the bytes of its output, at step 7"). Every Ingest stream of a session
of that run passes it on: on the Ack of its next batch, or, while the stream waits for one,
on an Ack sent just for it (stored 0, the session's acked_seq), so an agent between steps gets
it before the next step starts. The board validates and bounds what it sends (wire/limits.py):
at most MAX_DIRECTIVES_PER_RUN per run, each dropped after DIRECTIVE_TTL_S; a stream sends each
directive once (an agent that reconnects may get one again, and acts on each id once). A stream
whose session is known waits for its next batch and for the board at once (~12 us a batch); it
looks up its run and sends directives only while some escalating watch runs (`arm`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

from numaudit.auditor.daemon.ingest_wait import abandon
from numaudit.auditor.daemon.validate import ValidationError, check_run_name
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import limits


class DirectiveBoard:
    """The directives waiting for the sessions of each run, in the daemon's process (its event
    loop's thread only)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._by_run: dict[str, deque[tuple[pb.Directive, float]]] = {}
        self._changed: asyncio.Future | None = None
        self.armed = 0
        """Escalating watches running: streams listen for directives only while > 0."""
        self._takers: dict[str, dict[str, bool]] = {}
        """run -> session -> whether its agent said it takes directives (Register)."""

    # -- registrations --------------------------------------------------------------------------

    def note_register(self, run: str, session_id: str, takes: bool) -> None:
        sessions = self._takers.setdefault(run, {})
        if len(sessions) >= limits.MAX_WORLD_SIZE:
            sessions.clear()
        sessions[session_id] = takes

    def takers(self, run: str) -> tuple[int, int]:
        """(sessions of `run` that take directives, sessions registered) since the daemon
        started."""
        sessions = self._takers.get(run, {})
        return sum(sessions.values()), len(sessions)

    # -- posting ----------------------------------------------------------------------------------

    def arm(self) -> None:
        """An escalating watch starts: waiting streams wake to learn their session's run."""
        self.armed += 1
        self._wake()

    def _wake(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    def disarm(self) -> None:
        self.armed = max(0, self.armed - 1)

    def post(self, run: str, step: int, ops: list[str], payload: list[str],
             reason: str = "") -> pb.Directive:
        """Queue a directive for every session of `run`; ValidationError naming the field for
        one outside the bounds."""
        check_run_name(run, "run")
        if not 0 <= step <= limits.MAX_KEY_STEP:
            raise ValidationError("step", f"{step} is not a step number")
        for name, globs in (("ops", ops), ("payload", payload)):
            if len(globs) > limits.MAX_DIRECTIVE_GLOBS:
                raise ValidationError(name, f"{len(globs)} globs exceed the limit of "
                                            f"{limits.MAX_DIRECTIVE_GLOBS}")
            for i, g in enumerate(globs):
                if not g or len(g) > limits.MAX_DIRECTIVE_GLOB_CHARS or not g.isprintable():
                    raise ValidationError(f"{name}[{i}]", "empty, too long or not printable")
        if not ops:
            raise ValidationError("ops", "no module to capture")
        d = pb.Directive(id=next(self._ids), step=step, ops=ops, payload=payload,
                         reason=reason[:limits.MAX_DIRECTIVE_REASON_CHARS])
        queue = self._by_run.setdefault(run, deque(maxlen=limits.MAX_DIRECTIVES_PER_RUN))
        queue.append((d, time.monotonic()))
        self._wake()
        return d

    def pending(self, run: str | None, delivered: set[int]) -> list[pb.Directive]:
        """The directives for `run` a stream has not sent yet (expired ones dropped)."""
        queue = self._by_run.get(run) if run else None
        if not queue:
            return []
        now = time.monotonic()
        while queue and now - queue[0][1] > limits.DIRECTIVE_TTL_S:
            queue.popleft()
        return [d for d, _ in queue if d.id not in delivered]

    def changed(self) -> asyncio.Future:
        """Resolved at the next `post` or `arm`."""
        if self._changed is None or self._changed.done():
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed


class StreamDirectives:
    """One Ingest stream's side of the board: its session's run, what it sent."""

    def __init__(self, board: DirectiveBoard,
                 run_of: Callable[[str], Awaitable[str]]) -> None:
        self.board = board
        self._run_of = run_of
        self.session = ""
        self.run: str | None = None
        self.acked = 0
        self.delivered: set[int] = set()

    def listening(self) -> bool:
        """Whether the stream waits for directives too: once its session is known (its first
        batch came). A stream waiting since before an escalating watch started must wake for
        its directives (an agent between steps sends nothing); racing the wait costs ~12 us a
        batch."""
        return bool(self.session)

    async def on_ack(self, ack: pb.Ack) -> None:
        """Add the directives this stream has not sent to an Ack of a batch."""
        if ack.session_id != self.session:
            self.session, self.run, self.delivered = ack.session_id, None, set()
        self.acked = ack.acked_seq
        if not self.board.armed:
            return
        await self._learn_run()
        self._attach(ack)

    async def _learn_run(self) -> None:
        if self.run is None and self.session:
            try:
                self.run = await self._run_of(self.session)
            except Exception:  # an unknown session: nothing for it
                self.run = ""

    def _attach(self, ack: pb.Ack) -> bool:
        found = self.board.pending(self.run, self.delivered)
        if not found:
            return False
        self.delivered.update(d.id for d in found)
        ack.directives.extend(found)
        return True

    async def while_waiting(self, nxt: asyncio.Future) -> AsyncIterator[pb.Ack]:
        """Acks carrying directives, sent while the stream waits for its next batch (`nxt`,
        which the caller then reads). Cancelled, it abandons `nxt`."""
        try:
            while not nxt.done():
                if self.board.armed:
                    await self._learn_run()
                    ack = pb.Ack(session_id=self.session, acked_seq=self.acked)
                    if self._attach(ack):
                        yield ack
                        continue
                await asyncio.wait((nxt, self.board.changed()),
                                   return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the call ended while it waited: nobody reads `nxt` now
            abandon(nxt)  # (done or not: its exception, a StopAsyncIteration, is retrieved)
            raise
