from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class LayerRequest(_message.Message):
    __slots__ = ("seq", "layer", "hidden", "topk_ids", "topk_weights")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    layer: int
    hidden: Tensor
    topk_ids: Tensor
    topk_weights: Tensor
    def __init__(self, seq: _Optional[int] = ..., layer: _Optional[int] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., topk_ids: _Optional[_Union[Tensor, _Mapping]] = ..., topk_weights: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class LayerResponse(_message.Message):
    __slots__ = ("seq", "layer", "output", "compute_us", "server_us")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    SERVER_US_FIELD_NUMBER: _ClassVar[int]
    seq: int
    layer: int
    output: Tensor
    compute_us: int
    server_us: int
    def __init__(self, seq: _Optional[int] = ..., layer: _Optional[int] = ..., output: _Optional[_Union[Tensor, _Mapping]] = ..., compute_us: _Optional[int] = ..., server_us: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("shard_id", "layers", "experts", "slice_index", "slice_count", "intermediate_start", "intermediate_stop", "weight_format", "kernel", "model_fingerprint", "hidden_size", "n_routed_experts", "num_experts_per_tok", "weight_bytes", "max_tokens", "pid", "loaded_modules", "swiglu_limit", "act_bits", "instance_id")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    SLICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SLICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_START_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_STOP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    N_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_PER_TOK_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LOADED_MODULES_FIELD_NUMBER: _ClassVar[int]
    SWIGLU_LIMIT_FIELD_NUMBER: _ClassVar[int]
    ACT_BITS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    experts: _containers.RepeatedScalarFieldContainer[int]
    slice_index: int
    slice_count: int
    intermediate_start: int
    intermediate_stop: int
    weight_format: str
    kernel: str
    model_fingerprint: str
    hidden_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    weight_bytes: int
    max_tokens: int
    pid: int
    loaded_modules: _containers.RepeatedScalarFieldContainer[str]
    swiglu_limit: float
    act_bits: int
    instance_id: str
    def __init__(self, shard_id: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., experts: _Optional[_Iterable[int]] = ..., slice_index: _Optional[int] = ..., slice_count: _Optional[int] = ..., intermediate_start: _Optional[int] = ..., intermediate_stop: _Optional[int] = ..., weight_format: _Optional[str] = ..., kernel: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., hidden_size: _Optional[int] = ..., n_routed_experts: _Optional[int] = ..., num_experts_per_tok: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., max_tokens: _Optional[int] = ..., pid: _Optional[int] = ..., loaded_modules: _Optional[_Iterable[str]] = ..., swiglu_limit: _Optional[float] = ..., act_bits: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class AttachShmRequest(_message.Message):
    __slots__ = ("path", "token", "socket_path")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    token: bytes
    socket_path: str
    def __init__(self, path: _Optional[str] = ..., token: _Optional[bytes] = ..., socket_path: _Optional[str] = ...) -> None: ...

class AttachShmResponse(_message.Message):
    __slots__ = ("accepted", "reason", "instance_id")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    instance_id: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class AttachTcpRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttachTcpResponse(_message.Message):
    __slots__ = ("accepted", "reason", "port", "token", "instance_id")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    port: int
    token: bytes
    instance_id: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., port: _Optional[int] = ..., token: _Optional[bytes] = ..., instance_id: _Optional[str] = ...) -> None: ...
