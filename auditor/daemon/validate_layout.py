"""Validation of a record's layout: dtype, shapes, and the flags and fields that say how the piece
sits in its logical tensor (complex_as_real, flat, ragged, reduction); docs/protocol.md lists the
rules. Part of auditor/daemon/validate.py."""

from __future__ import annotations

import math

from numaudit.auditor.daemon.errors import ValidationError, short
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import limits

# Bytes per element, by torch dtype name without "torch.". Complex dtypes are listed for layouts
# sent as complex; complex_as_real layouts name the real dtype instead.
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1,
}
REAL_FLOAT_DTYPES = frozenset(
    d for d in ITEMSIZE if d.startswith("float") or d == "bfloat16"
)
REDUCTIONS = frozenset(pb.Reduction.values())
_INT64_MAX = (1 << 63) - 1


def check_layout(lay: pb.Layout, where: str) -> int:
    """Returns the piece's element count."""
    if lay.dtype not in ITEMSIZE:
        why = "missing" if not lay.dtype else f"{short(lay.dtype)} is not a known dtype"
        raise ValidationError(f"{where}.dtype", why)
    logical, offsets, shape = lay.logical_shape, lay.offsets, lay.shape
    ndim = len(logical)
    if ndim > limits.MAX_TENSOR_DIMS:
        raise ValidationError(f"{where}.logical_shape",
                              f"{ndim} dims exceed the limit of {limits.MAX_TENSOR_DIMS}")
    if len(offsets) != ndim or len(shape) != ndim:
        raise ValidationError(
            f"{where}.offsets" if len(offsets) != ndim else f"{where}.shape",
            f"lengths differ: logical_shape {ndim}, offsets {len(offsets)}, shape {len(shape)}",
        )
    for d in range(ndim):
        for name, values in (("logical_shape", logical), ("offsets", offsets), ("shape", shape)):
            if values[d] < 0:
                raise ValidationError(f"{where}.{name}[{d}]", f"{values[d]} is negative")
        if offsets[d] + shape[d] > logical[d]:
            raise ValidationError(
                f"{where}.offsets",
                f"offset {offsets[d]} + shape {shape[d]} exceeds logical_shape {logical[d]} "
                f"on dim {d}",
            )
    if math.prod(logical) > _INT64_MAX:
        raise ValidationError(f"{where}.logical_shape", "has more elements than an int64 counts")
    if lay.flat:
        _check_flat(lay, where)
    if lay.complex_as_real:
        if lay.dtype not in REAL_FLOAT_DTYPES:
            raise ValidationError(f"{where}.dtype", "complex_as_real needs the real floating "
                                                    f"dtype, not {lay.dtype}")
        if ndim == 0 or logical[-1] != 2 or shape[-1] != 2:
            raise ValidationError(f"{where}.shape", "complex_as_real needs a trailing dim of 2 "
                                                    "(real, imaginary) in logical_shape and shape")
    if lay.reduce != pb.REDUCTION_NONE:
        _check_reduction(lay, where)
    if lay.ragged_parts or lay.ragged_first or lay.ragged_span:
        _check_ragged(lay, where)
    return math.prod(shape)


def _check_flat(lay: pb.Layout, where: str) -> None:
    """A flat piece is a row-major range of its tensor's flattening, and nothing else besides
    (a replica of that range at most)."""
    if len(lay.logical_shape) != 1:
        raise ValidationError(f"{where}.logical_shape",
                              "a flat piece's logical_shape is its tensor's flattening: one dim, "
                              f"not {len(lay.logical_shape)}")
    if lay.ragged_parts or lay.ragged_first or lay.ragged_span:
        raise ValidationError(f"{where}.ragged_parts", "a flat piece is not ragged")
    if lay.partial:
        raise ValidationError(f"{where}.partial", "a flat piece is not a Partial addend")
    if lay.reduce != pb.REDUCTION_NONE:
        raise ValidationError(f"{where}.reduce", "a flat piece is not a reduction over the batch")
    if lay.complex_as_real:
        raise ValidationError(f"{where}.complex_as_real", "a flat piece is not complex_as_real")


def _check_ragged(lay: pb.Layout, where: str) -> None:
    """A ragged piece holds consecutive parts of a concatenation on dim 0, whole other dims."""
    if not 1 <= lay.ragged_parts <= limits.MAX_WORLD_SIZE:
        raise ValidationError(f"{where}.ragged_parts",
                              f"{lay.ragged_parts} is not in [1, {limits.MAX_WORLD_SIZE}] "
                              "(ragged_first and ragged_span need it)")
    if not 0 <= lay.ragged_first < lay.ragged_parts:
        raise ValidationError(f"{where}.ragged_first",
                              f"{lay.ragged_first} is not in [0, ragged_parts {lay.ragged_parts})")
    if not 1 <= lay.ragged_span <= lay.ragged_parts - lay.ragged_first:
        raise ValidationError(f"{where}.ragged_span",
                              f"{lay.ragged_span} is not in [1, ragged_parts - ragged_first = "
                              f"{lay.ragged_parts - lay.ragged_first}]")
    if not lay.logical_shape:
        raise ValidationError(f"{where}.logical_shape",
                              "a ragged piece has rows (at least one dim)")
    if list(lay.offsets[1:]) != [0] * (len(lay.offsets) - 1) or \
            list(lay.shape[1:]) != list(lay.logical_shape[1:]):
        raise ValidationError(f"{where}.shape", "a ragged piece is a slice of rows: offsets 0 and "
                                                "shape = logical_shape beyond dim 0")
    if lay.reduce != pb.REDUCTION_NONE:
        raise ValidationError(f"{where}.reduce", "a ragged piece is not a reduction over the batch")


def _check_reduction(lay: pb.Layout, where: str) -> None:
    """A reduction over the batch is one whole-tensor addend of known index among its count."""
    if lay.reduce not in REDUCTIONS:
        raise ValidationError(f"{where}.reduce", f"{lay.reduce} is not a Reduction")
    if lay.partial:
        raise ValidationError(f"{where}.partial", "a reduction over the batch is not also a "
                                                  "Partial addend: set one of reduce, partial")
    if list(lay.offsets) != [0] * len(lay.offsets) or list(lay.shape) != list(lay.logical_shape):
        raise ValidationError(f"{where}.shape", "a reduction over the batch covers its whole "
                                                "logical tensor (offsets 0, shape = logical_shape)")
    if not 1 <= lay.reduce_count <= limits.MAX_WORLD_SIZE:
        raise ValidationError(f"{where}.reduce_count",
                              f"{lay.reduce_count} is not in [1, {limits.MAX_WORLD_SIZE}]")
    if not 0 <= lay.reduce_index < lay.reduce_count:
        raise ValidationError(f"{where}.reduce_index",
                              f"{lay.reduce_index} is not in [0, reduce_count {lay.reduce_count})")
    if lay.reduce == pb.REDUCTION_MEAN and not (math.isfinite(lay.reduce_weight)
                                                 and lay.reduce_weight > 0):
        raise ValidationError(f"{where}.reduce_weight",
                              f"{lay.reduce_weight} is not a finite number > 0")
