from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRPC: _ClassVar[TransferMode]
    TORCH: _ClassVar[TransferMode]

class ReleaseReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELEASE_REASON_UNSPECIFIED: _ClassVar[ReleaseReason]
    ACKED: _ClassVar[ReleaseReason]
    ABORTED: _ClassVar[ReleaseReason]
    EXPIRED: _ClassVar[ReleaseReason]
    PEER_DEAD: _ClassVar[ReleaseReason]
    FAILED: _ClassVar[ReleaseReason]
GRPC: TransferMode
TORCH: TransferMode
RELEASE_REASON_UNSPECIFIED: ReleaseReason
ACKED: ReleaseReason
ABORTED: ReleaseReason
EXPIRED: ReleaseReason
PEER_DEAD: ReleaseReason
FAILED: ReleaseReason

class PullRequest(_message.Message):
    __slots__ = ("request_id", "attempt_id", "puller_id", "deadline", "mode", "group_id", "tag")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PULLER_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    attempt_id: str
    puller_id: str
    deadline: float
    mode: TransferMode
    group_id: str
    tag: int
    def __init__(self, request_id: _Optional[str] = ..., attempt_id: _Optional[str] = ..., puller_id: _Optional[str] = ..., deadline: _Optional[float] = ..., mode: _Optional[_Union[TransferMode, str]] = ..., group_id: _Optional[str] = ..., tag: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("layer", "offset", "checksums", "nbytes")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    layer: int
    offset: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, layer: _Optional[int] = ..., offset: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class KVMessage(_message.Message):
    __slots__ = ("header", "chunk", "trailer", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: bytes
    chunk: Chunk
    trailer: bytes
    data: bytes
    def __init__(self, header: _Optional[bytes] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., trailer: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVBatch(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[KVMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[KVMessage, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "attempt_id", "puller_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PULLER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    attempt_id: str
    puller_id: str
    reason: ReleaseReason
    def __init__(self, request_id: _Optional[str] = ..., attempt_id: _Optional[str] = ..., puller_id: _Optional[str] = ..., reason: _Optional[_Union[ReleaseReason, str]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PairGroupRequest(_message.Message):
    __slots__ = ("puller_id", "group_id", "backend", "timeout_s")
    PULLER_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    puller_id: str
    group_id: str
    backend: str
    timeout_s: float
    def __init__(self, puller_id: _Optional[str] = ..., group_id: _Optional[str] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PairGroupReply(_message.Message):
    __slots__ = ("store_port",)
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    store_port: int
    def __init__(self, store_port: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("exports",)
    EXPORTS_FIELD_NUMBER: _ClassVar[int]
    exports: int
    def __init__(self, exports: _Optional[int] = ...) -> None: ...
