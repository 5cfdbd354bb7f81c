"""Access control for numaudit.v1.Auditor: a grpc.aio server interceptor over a token file.

Authentication: every Auditor call must carry `authorization: Bearer TOKEN` (metadata on a
plaintext channel, call credentials over TLS) naming a token of the file, else UNAUTHENTICATED.
Authorization, before the handler runs: the RPC's scope (`RULES`) on the runs it touches, else
PERMISSION_DENIED. Register/DescribeRun/Compare/Watch name their runs; Ingest and CloseSession
name a session, whose run is looked up in the store (cached: a session never changes run). An
Ingest stream is checked when it opens (some write scope), then at its first batch and at every
batch whose session differs from the previous one. ListRuns answers only the runs the token may
read. Health and reflection are not intercepted: they stay open (docs/security.md).

Refusals are raised as `Unauthenticated`/`PermissionDenied` and turned into statuses by the
daemon's one mapping (`auditor.daemon.server.status_for`, passed in), and counted in the daemon's
metrics (`refused`, passed in) as the handlers' own refusals are. Logs name the token's `name`
from the file and the peer, never the token.

The grant of the call being handled is `current_grant()` (a context variable, set for the
handler's task): Register checks its scope again on the name the run is registered under, which
differs from the requested one when it belongs to another job and is renamed (NAME.2, ...): a
rename must never create or join a run the token may not write.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from numaudit.auditor.daemon.tokens import ESCALATE, READ, WRITE, Grant, Tokens
from numaudit.protos import numaudit_pb2 as pb

log = logging.getLogger(__name__)

SESSION_CACHE_SIZE = 65536
"""Session -> run entries kept; the cache is emptied when full (a miss costs one store read)."""


_GRANT: contextvars.ContextVar[Grant | None] = contextvars.ContextVar("numaudit_grant",
                                                                       default=None)


def current_grant() -> Grant | None:
    """The grant of the call whose handler runs now; None on a daemon without tokens."""
    return _GRANT.get()


def check_rename(grant: Grant | None, requested: str, run: str) -> None:
    """PermissionDenied unless `grant` (None: no tokens) may write `run`, the name a Register
    for `requested` is registered under (another name when that one is another job's)."""
    if grant is not None and not grant.may(WRITE, run):
        raise PermissionDenied(f"Register: token {grant.name!r} may not write run {run!r} "
                               f"({requested!r} belongs to another job and would be renamed "
                               "to it): choose another run name")


def check_escalate(grant: Grant | None, *runs: str) -> None:
    """PermissionDenied unless `grant` (None: no tokens) holds the escalate scope on every run
    of an escalating watch: it makes those runs' agents capture more (docs/security.md)."""
    for run in runs:
        if grant is not None and not grant.may(ESCALATE, run):
            raise PermissionDenied(f"Watch: token {grant.name!r} may not escalate run {run!r} "
                                   "(escalate scope): watch without --escalate, or use a token "
                                   "whose escalate globs name both runs")


class Unauthenticated(Exception):
    """No token, or not one of the file's (UNAUTHENTICATED)."""


class PermissionDenied(Exception):
    """A known token without the scope on the run (PERMISSION_DENIED)."""


@dataclass(frozen=True)
class Rule:
    """What an RPC needs: `scope` on the runs named by `runs(request)`, or on the session's run."""

    scope: str
    runs: Callable[[Any], Sequence[str]] | None = None
    by_session: bool = False


RULES: dict[str, Rule] = {
    "Register": Rule(WRITE, runs=lambda r: (r.run,)),
    "Ingest": Rule(WRITE, by_session=True),
    "CloseSession": Rule(WRITE, by_session=True),
    "ListRuns": Rule(READ),  # answer filtered to the readable runs
    "DescribeRun": Rule(READ, runs=lambda r: (r.run,)),
    "Compare": Rule(READ, runs=lambda r: (r.ref, r.cand)),
    "Watch": Rule(READ, runs=lambda r: (r.ref, r.cand)),
}
"""Every Auditor RPC; a method missing here is refused (PERMISSION_DENIED) — fail closed."""


def bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> str:
    """The token of the call's `authorization` entries; Unauthenticated if none or several differ.

    Over TLS a client may send the token twice (call credentials and explicit metadata): equal
    values are one token.
    """
    tokens = set()
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("authorization: expected 'Bearer TOKEN'")
        tokens.add(token.strip())
    if not tokens:
        raise Unauthenticated("authorization: no bearer token (set NUMAUDIT_TOKEN)")
    if len(tokens) > 1:
        raise Unauthenticated("authorization: more than one token")
    return tokens.pop()


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates and authorizes every call of `service`; other services pass untouched."""

    def __init__(self, tokens: Tokens, *, service: str,
                 session_run: Callable[[str], Awaitable[str]],
                 status_for: Callable[[BaseException, str], tuple[grpc.StatusCode, str]],
                 refused: Callable[[str, str, BaseException], None] | None = None) -> None:
        """`session_run(session_id)` gives the session's run or raises the store's UnknownSession;
        `status_for(exc, method)` maps refusals to statuses (the daemon's one mapping);
        `refused(method, code name, exc)` counts each refusal (the daemon's metrics)."""
        self._tokens = tokens
        self._prefix = f"/{service}/"
        self._session_run = session_run
        self._status_for = status_for
        self._refused = refused
        self._runs_of_sessions: dict[str, str] = {}

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails
                                ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler
        method = details.method[len(self._prefix):]
        try:
            token = bearer_token(details.invocation_metadata)
            grant = self._tokens.identify(token)
            if grant is None:
                raise Unauthenticated("authorization: unknown token")
            rule = RULES.get(method)
            if rule is None:
                raise PermissionDenied(f"{method}: no access rule for this method")
            if not grant.has(rule.scope):
                raise PermissionDenied(f"{method}: token {grant.name!r} has no {rule.scope} scope")
        except (Unauthenticated, PermissionDenied) as exc:
            return _refusing(handler, self._refuse, method, exc)
        return _Checked(self, handler, method, rule, grant).handler()

    async def _refuse(self, context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
        code, details = self._status_for(exc, self._prefix + method)
        if self._refused is not None:
            self._refused(method, code.name, exc)
        log.warning("%s from %s refused: %s %s", method, context.peer(), code.name, details)
        await context.abort(code, details)

    async def run_of_session(self, session_id: str) -> str:
        run = self._runs_of_sessions.get(session_id)
        if run is None:
            run = await self._session_run(session_id)  # UnknownSession propagates
            if len(self._runs_of_sessions) >= SESSION_CACHE_SIZE:
                self._runs_of_sessions.clear()
            self._runs_of_sessions[session_id] = run
        return run


class _Checked:
    """One call's authorization around the real handler's behaviour."""

    def __init__(self, auth: AuthInterceptor, handler: grpc.RpcMethodHandler, method: str,
                 rule: Rule, grant: Grant) -> None:
        self.auth, self.inner, self.method = auth, handler, method
        self.rule, self.grant = rule, grant

    def handler(self) -> grpc.RpcMethodHandler:
        h = self.inner
        if not h.request_streaming and not h.response_streaming:
            return h._replace(unary_unary=self.unary_unary)
        if not h.request_streaming:
            return h._replace(unary_stream=self.unary_stream)
        if h.response_streaming:
            return h._replace(stream_stream=self.stream_stream)
        return h._replace(stream_unary=self.stream_unary)

    async def check(self, request: Any) -> None:
        """PermissionDenied unless the token holds the rule's scope on every run of `request`.

        A request that did not parse passes: the handler refuses it (INVALID_ARGUMENT).
        """
        if not isinstance(request, Message):
            return
        if self.rule.by_session:
            runs: Sequence[str] = (await self.auth.run_of_session(request.session_id),)
        elif self.rule.runs is not None:
            runs = self.rule.runs(request)
        else:
            return
        for run in runs:
            if not self.grant.may(self.rule.scope, run):
                raise PermissionDenied(f"{self.method}: token {self.grant.name!r} may not "
                                       f"{self.rule.scope} run {run!r}")

    async def unary_unary(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            await self.check(request)
        except Exception as exc:  # PermissionDenied, UnknownSession, store errors
            await self.auth._refuse(context, self.method, exc)
        _GRANT.set(self.grant)  # this call's task only: the handler runs in it
        response = await self.inner.unary_unary(request, context)
        if self.method == "ListRuns":
            if isinstance(response, bytes):  # a reply serialized elsewhere is filtered too
                response = pb.ListRunsResponse.FromString(response)
            readable = [r for r in response.runs if self.grant.may(READ, r.run)]
            del response.runs[:]
            response.runs.extend(readable)
        return response

    async def unary_stream(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
        try:
            await self.check(request)
        except Exception as exc:
            await self.auth._refuse(context, self.method, exc)
        _GRANT.set(self.grant)
        async for item in _responses(self.inner.unary_stream(request, context)):
            yield item

    async def stream_stream(self, requests: AsyncIterator, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator:
        _GRANT.set(self.grant)
        # Refusals raised inside the request iterator reach the handler, which ends the stream
        # through status_for after acking the batches before (as for any rejected batch).
        async for item in _responses(self.inner.stream_stream(self.checked(requests), context)):
            yield item

    async def stream_unary(self, requests: AsyncIterator, context: grpc.aio.ServicerContext) -> Any:
        return await self.inner.stream_unary(self.checked(requests), context)

    async def checked(self, requests: AsyncIterator) -> AsyncIterator:
        last_session = None
        async for request in requests:
            session = getattr(request, "session_id", None) if self.rule.by_session else None
            if session is None or session != last_session:
                await self.check(request)
                last_session = session
            yield request


async def _responses(result: Any) -> AsyncIterator:
    """A streaming handler's responses, whether it is an async generator or writes itself."""
    if inspect.isasyncgen(result):
        async for item in result:
            yield item
    else:
        await result


def _refusing(handler: grpc.RpcMethodHandler, refuse: Callable, method: str,
              exc: Exception) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers every call with `exc`'s status."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        await refuse(context, method, exc)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
        await refuse(context, method, exc)
        yield  # pragma: no cover - makes this an async generator

    if not handler.request_streaming and not handler.response_streaming:
        return handler._replace(unary_unary=unary)
    if not handler.request_streaming:
        return handler._replace(unary_stream=streaming)
    if handler.response_streaming:
        return handler._replace(stream_stream=streaming)
    return handler._replace(stream_unary=unary)
