"""Server reflection answers under grpc.reflection.v1 (grpcurl's default) and v1alpha, against a
real in-process daemon, with and without tokens (reflection stays open)."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

from numaudit.auditor.daemon.server import BackgroundServer
from numaudit.auditor.daemon.tokens import Tokens

T = 10
pytestmark = pytest.mark.timeout(60)
VERSIONS = ("grpc.reflection.v1", "grpc.reflection.v1alpha")
SERVICES = {"numaudit.v1.Auditor", "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}


def ask(channel: grpc.Channel, version: str, **request) -> reflection_pb2.ServerReflectionResponse:
    """One reflection request over `version` (both versions' messages are the same on the wire;
    grpcio-reflection ships v1alpha's classes only)."""
    call = channel.stream_stream(
        f"/{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    [resp] = list(call(iter([reflection_pb2.ServerReflectionRequest(**request)]), timeout=T))
    return resp


def _symbols(resp: reflection_pb2.ServerReflectionResponse) -> set[str]:
    names = set()
    for raw in resp.file_descriptor_response.file_descriptor_proto:
        fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
        names |= {f"{fd.package}.{s.name}" for s in fd.service}
    return names


@pytest.mark.parametrize("version", VERSIONS)
def test_both_reflection_versions_list_and_describe_the_services(auditor_server, version):
    with grpc.insecure_channel(auditor_server.address) as channel:
        listed = ask(channel, version, list_services="")
        assert {s.name for s in listed.list_services_response.service} == SERVICES
        for service in ("numaudit.v1.Auditor", f"{version}.ServerReflection"):
            resp = ask(channel, version, file_containing_symbol=service)
            assert service in _symbols(resp), resp.error_response


def test_reflection_needs_no_token(tmp_path):
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text('[[token]]\nname = "ci"\ntoken = "a-secret-of-32-characters-or-so"\n'
                           'read = ["*"]\n')
    with BackgroundServer("127.0.0.1:0", tmp_path / "audit.db", grace=0.5,
                          tokens=Tokens.load(tokens_file)) as srv:
        with grpc.insecure_channel(srv.address) as channel:
            for version in VERSIONS:
                listed = ask(channel, version, list_services="")
                assert "numaudit.v1.Auditor" in {s.name for s in
                                                 listed.list_services_response.service}
