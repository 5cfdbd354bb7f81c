from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SchemaVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEMA_VERSION_UNSPECIFIED: _ClassVar[SchemaVersion]
    SCHEMA_VERSION_1: _ClassVar[SchemaVersion]

class Reduction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REDUCTION_NONE: _ClassVar[Reduction]
    REDUCTION_MEAN: _ClassVar[Reduction]
    REDUCTION_SUM: _ClassVar[Reduction]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_FWD: _ClassVar[Phase]
    PHASE_BWD: _ClassVar[Phase]
    PHASE_GRAD: _ClassVar[Phase]
    PHASE_PARAM: _ClassVar[Phase]
    PHASE_LOSS: _ClassVar[Phase]
    PHASE_INPUT: _ClassVar[Phase]
    PHASE_OPTIM_GRAD: _ClassVar[Phase]
    PHASE_UPDATE: _ClassVar[Phase]
    PHASE_STATE: _ClassVar[Phase]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_OUTPUT: _ClassVar[Role]
    ROLE_INPUT: _ClassVar[Role]
    ROLE_GRAD_OUTPUT: _ClassVar[Role]
    ROLE_GRAD_INPUT: _ClassVar[Role]
    ROLE_VALUE: _ClassVar[Role]
SCHEMA_VERSION_UNSPECIFIED: SchemaVersion
SCHEMA_VERSION_1: SchemaVersion
REDUCTION_NONE: Reduction
REDUCTION_MEAN: Reduction
REDUCTION_SUM: Reduction
PHASE_UNSPECIFIED: Phase
PHASE_FWD: Phase
PHASE_BWD: Phase
PHASE_GRAD: Phase
PHASE_PARAM: Phase
PHASE_LOSS: Phase
PHASE_INPUT: Phase
PHASE_OPTIM_GRAD: Phase
PHASE_UPDATE: Phase
PHASE_STATE: Phase
ROLE_UNSPECIFIED: Role
ROLE_OUTPUT: Role
ROLE_INPUT: Role
ROLE_GRAD_OUTPUT: Role
ROLE_GRAD_INPUT: Role
ROLE_VALUE: Role

class Key(_message.Message):
    __slots__ = ("step", "microbatch", "phase", "site", "role", "index", "call")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    step: int
    microbatch: int
    phase: Phase
    site: str
    role: Role
    index: int
    call: int
    def __init__(self, step: _Optional[int] = ..., microbatch: _Optional[int] = ..., phase: _Optional[_Union[Phase, str]] = ..., site: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., index: _Optional[int] = ..., call: _Optional[int] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("logical_shape", "offsets", "shape", "replica", "partial", "dtype", "complex_as_real", "reduce", "reduce_weight", "reduce_index", "reduce_count", "ragged_parts", "ragged_first", "ragged_span", "flat")
    LOGICAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    COMPLEX_AS_REAL_FIELD_NUMBER: _ClassVar[int]
    REDUCE_FIELD_NUMBER: _ClassVar[int]
    REDUCE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    REDUCE_INDEX_FIELD_NUMBER: _ClassVar[int]
    REDUCE_COUNT_FIELD_NUMBER: _ClassVar[int]
    RAGGED_PARTS_FIELD_NUMBER: _ClassVar[int]
    RAGGED_FIRST_FIELD_NUMBER: _ClassVar[int]
    RAGGED_SPAN_FIELD_NUMBER: _ClassVar[int]
    FLAT_FIELD_NUMBER: _ClassVar[int]
    logical_shape: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    replica: bool
    partial: bool
    dtype: str
    complex_as_real: bool
    reduce: Reduction
    reduce_weight: float
    reduce_index: int
    reduce_count: int
    ragged_parts: int
    ragged_first: int
    ragged_span: int
    flat: bool
    def __init__(self, logical_shape: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., shape: _Optional[_Iterable[int]] = ..., replica: _Optional[bool] = ..., partial: _Optional[bool] = ..., dtype: _Optional[str] = ..., complex_as_real: _Optional[bool] = ..., reduce: _Optional[_Union[Reduction, str]] = ..., reduce_weight: _Optional[float] = ..., reduce_index: _Optional[int] = ..., reduce_count: _Optional[int] = ..., ragged_parts: _Optional[int] = ..., ragged_first: _Optional[int] = ..., ragged_span: _Optional[int] = ..., flat: _Optional[bool] = ...) -> None: ...

class Digest(_message.Message):
    __slots__ = ("numel", "nan_count", "posinf_count", "neginf_count", "zero_count", "has_moments", "sum", "sum_sq", "min", "max", "abs_max", "fingerprint", "fingerprint_seed", "sketch", "sketch_seed")
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    NAN_COUNT_FIELD_NUMBER: _ClassVar[int]
    POSINF_COUNT_FIELD_NUMBER: _ClassVar[int]
    NEGINF_COUNT_FIELD_NUMBER: _ClassVar[int]
    ZERO_COUNT_FIELD_NUMBER: _ClassVar[int]
    HAS_MOMENTS_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    SUM_SQ_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    ABS_MAX_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_SEED_FIELD_NUMBER: _ClassVar[int]
    SKETCH_FIELD_NUMBER: _ClassVar[int]
    SKETCH_SEED_FIELD_NUMBER: _ClassVar[int]
    numel: int
    nan_count: int
    posinf_count: int
    neginf_count: int
    zero_count: int
    has_moments: bool
    sum: float
    sum_sq: float
    min: float
    max: float
    abs_max: float
    fingerprint: int
    fingerprint_seed: int
    sketch: _containers.RepeatedScalarFieldContainer[float]
    sketch_seed: int
    def __init__(self, numel: _Optional[int] = ..., nan_count: _Optional[int] = ..., posinf_count: _Optional[int] = ..., neginf_count: _Optional[int] = ..., zero_count: _Optional[int] = ..., has_moments: _Optional[bool] = ..., sum: _Optional[float] = ..., sum_sq: _Optional[float] = ..., min: _Optional[float] = ..., max: _Optional[float] = ..., abs_max: _Optional[float] = ..., fingerprint: _Optional[int] = ..., fingerprint_seed: _Optional[int] = ..., sketch: _Optional[_Iterable[float]] = ..., sketch_seed: _Optional[int] = ...) -> None: ...

class SampleDigests(_message.Message):
    __slots__ = ("dim", "unit", "count", "sketch_k", "values", "fingerprints")
    DIM_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SKETCH_K_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    dim: int
    unit: int
    count: int
    sketch_k: int
    values: _containers.RepeatedScalarFieldContainer[float]
    fingerprints: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dim: _Optional[int] = ..., unit: _Optional[int] = ..., count: _Optional[int] = ..., sketch_k: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ..., fingerprints: _Optional[_Iterable[int]] = ...) -> None: ...

class Payload(_message.Message):
    __slots__ = ("codec", "raw_nbytes", "compressed_nbytes", "crc32", "chunk_index", "chunk_count", "data")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RAW_NBYTES_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_NBYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    codec: str
    raw_nbytes: int
    compressed_nbytes: int
    crc32: int
    chunk_index: int
    chunk_count: int
    data: bytes
    def __init__(self, codec: _Optional[str] = ..., raw_nbytes: _Optional[int] = ..., compressed_nbytes: _Optional[int] = ..., crc32: _Optional[int] = ..., chunk_index: _Optional[int] = ..., chunk_count: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Record(_message.Message):
    __slots__ = ("key", "stage", "layout", "is_none", "digest", "payload", "capture_order", "samples")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    IS_NONE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_ORDER_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    key: Key
    stage: int
    layout: Layout
    is_none: bool
    digest: Digest
    payload: Payload
    capture_order: int
    samples: SampleDigests
    def __init__(self, key: _Optional[_Union[Key, _Mapping]] = ..., stage: _Optional[int] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., is_none: _Optional[bool] = ..., digest: _Optional[_Union[Digest, _Mapping]] = ..., payload: _Optional[_Union[Payload, _Mapping]] = ..., capture_order: _Optional[int] = ..., samples: _Optional[_Union[SampleDigests, _Mapping]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("schema_version", "run", "session_id", "rank", "world_size", "mesh_shape", "mesh_dim_names", "mesh_coordinate", "stages", "torch_version", "dtype", "seed", "labels", "host", "local_rank", "job_id", "rename_if_taken", "grad_scale", "grad_scale_source", "agent_version", "takes_directives")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MESH_SHAPE_FIELD_NUMBER: _ClassVar[int]
    MESH_DIM_NAMES_FIELD_NUMBER: _ClassVar[int]
    MESH_COORDINATE_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RENAME_IF_TAKEN_FIELD_NUMBER: _ClassVar[int]
    GRAD_SCALE_FIELD_NUMBER: _ClassVar[int]
    GRAD_SCALE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TAKES_DIRECTIVES_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    run: str
    session_id: str
    rank: int
    world_size: int
    mesh_shape: _containers.RepeatedScalarFieldContainer[int]
    mesh_dim_names: _containers.RepeatedScalarFieldContainer[str]
    mesh_coordinate: _containers.RepeatedScalarFieldContainer[int]
    stages: _containers.RepeatedScalarFieldContainer[int]
    torch_version: str
    dtype: str
    seed: int
    labels: _containers.ScalarMap[str, str]
    host: str
    local_rank: int
    job_id: str
    rename_if_taken: bool
    grad_scale: float
    grad_scale_source: str
    agent_version: str
    takes_directives: bool
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ..., run: _Optional[str] = ..., session_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., mesh_shape: _Optional[_Iterable[int]] = ..., mesh_dim_names: _Optional[_Iterable[str]] = ..., mesh_coordinate: _Optional[_Iterable[int]] = ..., stages: _Optional[_Iterable[int]] = ..., torch_version: _Optional[str] = ..., dtype: _Optional[str] = ..., seed: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., host: _Optional[str] = ..., local_rank: _Optional[int] = ..., job_id: _Optional[str] = ..., rename_if_taken: _Optional[bool] = ..., grad_scale: _Optional[float] = ..., grad_scale_source: _Optional[str] = ..., agent_version: _Optional[str] = ..., takes_directives: _Optional[bool] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("session_id", "acked_seq", "run", "packed_batches", "packed_payloads")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    PACKED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    PACKED_PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    acked_seq: int
    run: str
    packed_batches: bool
    packed_payloads: bool
    def __init__(self, session_id: _Optional[str] = ..., acked_seq: _Optional[int] = ..., run: _Optional[str] = ..., packed_batches: _Optional[bool] = ..., packed_payloads: _Optional[bool] = ...) -> None: ...

class PackedRecords(_message.Message):
    __slots__ = ("count", "sites", "site", "step", "microbatch", "phase", "role", "index", "call", "stage", "flags", "dtypes", "dtype", "ndim", "dims", "reduce", "reduce_weight", "reduce_index", "reduce_count", "ragged_parts", "ragged_first", "ragged_span", "numel", "nan_count", "posinf_count", "neginf_count", "zero_count", "sum", "sum_sq", "min", "max", "abs_max", "fingerprint", "fingerprint_seed", "sketch_seed", "sketch_len", "sketch", "payloads", "capture_order", "sample_dim", "sample_unit", "sample_count", "sample_k", "sample_values", "sample_fingerprints")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NDIM_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    REDUCE_FIELD_NUMBER: _ClassVar[int]
    REDUCE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    REDUCE_INDEX_FIELD_NUMBER: _ClassVar[int]
    REDUCE_COUNT_FIELD_NUMBER: _ClassVar[int]
    RAGGED_PARTS_FIELD_NUMBER: _ClassVar[int]
    RAGGED_FIRST_FIELD_NUMBER: _ClassVar[int]
    RAGGED_SPAN_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    NAN_COUNT_FIELD_NUMBER: _ClassVar[int]
    POSINF_COUNT_FIELD_NUMBER: _ClassVar[int]
    NEGINF_COUNT_FIELD_NUMBER: _ClassVar[int]
    ZERO_COUNT_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    SUM_SQ_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    ABS_MAX_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_SEED_FIELD_NUMBER: _ClassVar[int]
    SKETCH_SEED_FIELD_NUMBER: _ClassVar[int]
    SKETCH_LEN_FIELD_NUMBER: _ClassVar[int]
    SKETCH_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_ORDER_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_DIM_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_UNIT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_COUNT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_K_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_VALUES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    count: int
    sites: _containers.RepeatedScalarFieldContainer[str]
    site: bytes
    step: bytes
    microbatch: bytes
    phase: bytes
    role: bytes
    index: bytes
    call: bytes
    stage: bytes
    flags: bytes
    dtypes: _containers.RepeatedScalarFieldContainer[str]
    dtype: bytes
    ndim: bytes
    dims: bytes
    reduce: bytes
    reduce_weight: bytes
    reduce_index: bytes
    reduce_count: bytes
    ragged_parts: bytes
    ragged_first: bytes
    ragged_span: bytes
    numel: bytes
    nan_count: bytes
    posinf_count: bytes
    neginf_count: bytes
    zero_count: bytes
    sum: bytes
    sum_sq: bytes
    min: bytes
    max: bytes
    abs_max: bytes
    fingerprint: bytes
    fingerprint_seed: bytes
    sketch_seed: bytes
    sketch_len: bytes
    sketch: bytes
    payloads: _containers.RepeatedCompositeFieldContainer[PackedPayload]
    capture_order: bytes
    sample_dim: bytes
    sample_unit: bytes
    sample_count: bytes
    sample_k: bytes
    sample_values: bytes
    sample_fingerprints: bytes
    def __init__(self, count: _Optional[int] = ..., sites: _Optional[_Iterable[str]] = ..., site: _Optional[bytes] = ..., step: _Optional[bytes] = ..., microbatch: _Optional[bytes] = ..., phase: _Optional[bytes] = ..., role: _Optional[bytes] = ..., index: _Optional[bytes] = ..., call: _Optional[bytes] = ..., stage: _Optional[bytes] = ..., flags: _Optional[bytes] = ..., dtypes: _Optional[_Iterable[str]] = ..., dtype: _Optional[bytes] = ..., ndim: _Optional[bytes] = ..., dims: _Optional[bytes] = ..., reduce: _Optional[bytes] = ..., reduce_weight: _Optional[bytes] = ..., reduce_index: _Optional[bytes] = ..., reduce_count: _Optional[bytes] = ..., ragged_parts: _Optional[bytes] = ..., ragged_first: _Optional[bytes] = ..., ragged_span: _Optional[bytes] = ..., numel: _Optional[bytes] = ..., nan_count: _Optional[bytes] = ..., posinf_count: _Optional[bytes] = ..., neginf_count: _Optional[bytes] = ..., zero_count: _Optional[bytes] = ..., sum: _Optional[bytes] = ..., sum_sq: _Optional[bytes] = ..., min: _Optional[bytes] = ..., max: _Optional[bytes] = ..., abs_max: _Optional[bytes] = ..., fingerprint: _Optional[bytes] = ..., fingerprint_seed: _Optional[bytes] = ..., sketch_seed: _Optional[bytes] = ..., sketch_len: _Optional[bytes] = ..., sketch: _Optional[bytes] = ..., payloads: _Optional[_Iterable[_Union[PackedPayload, _Mapping]]] = ..., capture_order: _Optional[bytes] = ..., sample_dim: _Optional[bytes] = ..., sample_unit: _Optional[bytes] = ..., sample_count: _Optional[bytes] = ..., sample_k: _Optional[bytes] = ..., sample_values: _Optional[bytes] = ..., sample_fingerprints: _Optional[bytes] = ...) -> None: ...

class PackedPayload(_message.Message):
    __slots__ = ("row", "payload")
    ROW_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    row: int
    payload: Payload
    def __init__(self, row: _Optional[int] = ..., payload: _Optional[_Union[Payload, _Mapping]] = ...) -> None: ...

class RecordBatch(_message.Message):
    __slots__ = ("schema_version", "session_id", "seq", "records", "records_crc32", "packed")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_CRC32_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    session_id: str
    seq: int
    records: _containers.RepeatedCompositeFieldContainer[Record]
    records_crc32: int
    packed: PackedRecords
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ..., session_id: _Optional[str] = ..., seq: _Optional[int] = ..., records: _Optional[_Iterable[_Union[Record, _Mapping]]] = ..., records_crc32: _Optional[int] = ..., packed: _Optional[_Union[PackedRecords, _Mapping]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("session_id", "acked_seq", "stored", "duplicates", "conflicts", "packed_batches", "packed_payloads", "directives")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    CONFLICTS_FIELD_NUMBER: _ClassVar[int]
    PACKED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    PACKED_PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    acked_seq: int
    stored: int
    duplicates: int
    conflicts: int
    packed_batches: bool
    packed_payloads: bool
    directives: _containers.RepeatedCompositeFieldContainer[Directive]
    def __init__(self, session_id: _Optional[str] = ..., acked_seq: _Optional[int] = ..., stored: _Optional[int] = ..., duplicates: _Optional[int] = ..., conflicts: _Optional[int] = ..., packed_batches: _Optional[bool] = ..., packed_payloads: _Optional[bool] = ..., directives: _Optional[_Iterable[_Union[Directive, _Mapping]]] = ...) -> None: ...

class Directive(_message.Message):
    __slots__ = ("id", "step", "ops", "payload", "reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    id: int
    step: int
    ops: _containers.RepeatedScalarFieldContainer[str]
    payload: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, id: _Optional[int] = ..., step: _Optional[int] = ..., ops: _Optional[_Iterable[str]] = ..., payload: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("schema_version", "session_id", "records_sent", "records_dropped", "capture_errors", "dropped_by_reason")
    class DroppedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RECORDS_SENT_FIELD_NUMBER: _ClassVar[int]
    RECORDS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    session_id: str
    records_sent: int
    records_dropped: int
    capture_errors: int
    dropped_by_reason: _containers.ScalarMap[str, int]
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ..., session_id: _Optional[str] = ..., records_sent: _Optional[int] = ..., records_dropped: _Optional[int] = ..., capture_errors: _Optional[int] = ..., dropped_by_reason: _Optional[_Mapping[str, int]] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("records_stored",)
    RECORDS_STORED_FIELD_NUMBER: _ClassVar[int]
    records_stored: int
    def __init__(self, records_stored: _Optional[int] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunSummary(_message.Message):
    __slots__ = ("run", "world_size", "ranks_registered", "ranks_closed", "records", "created_unix")
    RUN_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    RANKS_CLOSED_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    run: str
    world_size: int
    ranks_registered: int
    ranks_closed: int
    records: int
    created_unix: float
    def __init__(self, run: _Optional[str] = ..., world_size: _Optional[int] = ..., ranks_registered: _Optional[int] = ..., ranks_closed: _Optional[int] = ..., records: _Optional[int] = ..., created_unix: _Optional[float] = ...) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunSummary]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunSummary, _Mapping]]] = ...) -> None: ...

class DescribeRunRequest(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: str
    def __init__(self, run: _Optional[str] = ...) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("rank", "session_id", "mesh_coordinate", "stages", "host", "records_stored", "records_sent", "records_dropped", "closed", "dropped_by_reason", "agent_version")
    class DroppedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MESH_COORDINATE_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    RECORDS_STORED_FIELD_NUMBER: _ClassVar[int]
    RECORDS_SENT_FIELD_NUMBER: _ClassVar[int]
    RECORDS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    session_id: str
    mesh_coordinate: _containers.RepeatedScalarFieldContainer[int]
    stages: _containers.RepeatedScalarFieldContainer[int]
    host: str
    records_stored: int
    records_sent: int
    records_dropped: int
    closed: bool
    dropped_by_reason: _containers.ScalarMap[str, int]
    agent_version: str
    def __init__(self, rank: _Optional[int] = ..., session_id: _Optional[str] = ..., mesh_coordinate: _Optional[_Iterable[int]] = ..., stages: _Optional[_Iterable[int]] = ..., host: _Optional[str] = ..., records_stored: _Optional[int] = ..., records_sent: _Optional[int] = ..., records_dropped: _Optional[int] = ..., closed: _Optional[bool] = ..., dropped_by_reason: _Optional[_Mapping[str, int]] = ..., agent_version: _Optional[str] = ...) -> None: ...

class PhaseCount(_message.Message):
    __slots__ = ("phase", "sites", "records", "none_records")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    NONE_RECORDS_FIELD_NUMBER: _ClassVar[int]
    phase: Phase
    sites: int
    records: int
    none_records: int
    def __init__(self, phase: _Optional[_Union[Phase, str]] = ..., sites: _Optional[int] = ..., records: _Optional[int] = ..., none_records: _Optional[int] = ...) -> None: ...

class DescribeRunResponse(_message.Message):
    __slots__ = ("summary", "mesh_shape", "mesh_dim_names", "torch_version", "dtype", "seed", "labels", "ranks", "steps", "microbatches", "phases", "conflicts", "none_grad_sites")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    MESH_SHAPE_FIELD_NUMBER: _ClassVar[int]
    MESH_DIM_NAMES_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    CONFLICTS_FIELD_NUMBER: _ClassVar[int]
    NONE_GRAD_SITES_FIELD_NUMBER: _ClassVar[int]
    summary: RunSummary
    mesh_shape: _containers.RepeatedScalarFieldContainer[int]
    mesh_dim_names: _containers.RepeatedScalarFieldContainer[str]
    torch_version: str
    dtype: str
    seed: int
    labels: _containers.ScalarMap[str, str]
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    steps: _containers.RepeatedScalarFieldContainer[int]
    microbatches: int
    phases: _containers.RepeatedCompositeFieldContainer[PhaseCount]
    conflicts: int
    none_grad_sites: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, summary: _Optional[_Union[RunSummary, _Mapping]] = ..., mesh_shape: _Optional[_Iterable[int]] = ..., mesh_dim_names: _Optional[_Iterable[str]] = ..., torch_version: _Optional[str] = ..., dtype: _Optional[str] = ..., seed: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ..., steps: _Optional[_Iterable[int]] = ..., microbatches: _Optional[int] = ..., phases: _Optional[_Iterable[_Union[PhaseCount, _Mapping]]] = ..., conflicts: _Optional[int] = ..., none_grad_sites: _Optional[_Iterable[str]] = ...) -> None: ...

class CompareRequest(_message.Message):
    __slots__ = ("ref", "cand", "policy_toml", "preset")
    REF_FIELD_NUMBER: _ClassVar[int]
    CAND_FIELD_NUMBER: _ClassVar[int]
    POLICY_TOML_FIELD_NUMBER: _ClassVar[int]
    PRESET_FIELD_NUMBER: _ClassVar[int]
    ref: str
    cand: str
    policy_toml: str
    preset: str
    def __init__(self, ref: _Optional[str] = ..., cand: _Optional[str] = ..., policy_toml: _Optional[str] = ..., preset: _Optional[str] = ...) -> None: ...

class CompareResponse(_message.Message):
    __slots__ = ("report_json", "exit_code")
    REPORT_JSON_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    report_json: str
    exit_code: int
    def __init__(self, report_json: _Optional[str] = ..., exit_code: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("ref", "cand", "policy_toml", "preset", "poll_interval_s", "timeout_s", "escalate")
    REF_FIELD_NUMBER: _ClassVar[int]
    CAND_FIELD_NUMBER: _ClassVar[int]
    POLICY_TOML_FIELD_NUMBER: _ClassVar[int]
    PRESET_FIELD_NUMBER: _ClassVar[int]
    POLL_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ESCALATE_FIELD_NUMBER: _ClassVar[int]
    ref: str
    cand: str
    policy_toml: str
    preset: str
    poll_interval_s: float
    timeout_s: float
    escalate: bool
    def __init__(self, ref: _Optional[str] = ..., cand: _Optional[str] = ..., policy_toml: _Optional[str] = ..., preset: _Optional[str] = ..., poll_interval_s: _Optional[float] = ..., timeout_s: _Optional[float] = ..., escalate: _Optional[bool] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("finding_json", "first_divergence", "status", "drill_json")
    FINDING_JSON_FIELD_NUMBER: _ClassVar[int]
    FIRST_DIVERGENCE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DRILL_JSON_FIELD_NUMBER: _ClassVar[int]
    finding_json: str
    first_divergence: bool
    status: str
    drill_json: str
    def __init__(self, finding_json: _Optional[str] = ..., first_divergence: _Optional[bool] = ..., status: _Optional[str] = ..., drill_json: _Optional[str] = ...) -> None: ...
