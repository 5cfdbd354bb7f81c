"""gRPC server reflection under both names clients use: `grpc.reflection.v1` and `v1alpha`.

grpcurl and most current tools ask `grpc.reflection.v1.ServerReflection` first; older ones ask
`grpc.reflection.v1alpha.ServerReflection`. grpcio-reflection (1.85) ships only v1alpha. The two
protos are the same messages with the same field numbers under another package name, so the
v1alpha servicer answers v1 callers byte for byte: registered here under the v1 service name, and
the v1 proto (v1alpha's descriptor with its package renamed) is added to the descriptor pool so
that `grpcurl describe grpc.reflection.v1.ServerReflection` works too.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
"""grpc.reflection.v1alpha.ServerReflection"""


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Add grpc/reflection/v1/reflection.proto to `pool` (once), built from v1alpha's."""
    try:
        pool.FindServiceByName(V1_SERVICE_NAME)
        return
    except KeyError:
        pass
    old = reflection_pb2.DESCRIPTOR.package
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", V1_PACKAGE
    proto.ClearField("options")
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(f".{old}.", f".{V1_PACKAGE}.")
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(f".{old}.", f".{V1_PACKAGE}.")
        method.output_type = method.output_type.replace(f".{old}.", f".{V1_PACKAGE}.")
    pool.Add(proto)


def enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection for `service_names` (plus both reflection services) on `server`."""
    _add_v1_descriptor(descriptor_pool.Default())
    names = tuple(service_names) + (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection.enable_server_reflection(names, server)  # v1alpha, from the library
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString),
    }),))
