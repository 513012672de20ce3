from ecrec.wire import cluster_pb2 as _cluster_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetCoordinatorsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CoordinatorInfo(_message.Message):
    __slots__ = ("address", "leads")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEADS_FIELD_NUMBER: _ClassVar[int]
    address: str
    leads: bool
    def __init__(self, address: _Optional[str] = ..., leads: _Optional[bool] = ...) -> None: ...

class GetCoordinatorsReply(_message.Message):
    __slots__ = ("answered_by", "leader", "coordinators", "store")
    ANSWERED_BY_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    COORDINATORS_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    answered_by: str
    leader: str
    coordinators: _containers.RepeatedCompositeFieldContainer[CoordinatorInfo]
    store: str
    def __init__(self, answered_by: _Optional[str] = ..., leader: _Optional[str] = ..., coordinators: _Optional[_Iterable[_Union[CoordinatorInfo, _Mapping]]] = ..., store: _Optional[str] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("server_id", "index", "epoch")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    index: int
    epoch: int
    def __init__(self, server_id: _Optional[str] = ..., index: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class RenewLeaseReply(_message.Message):
    __slots__ = ("granted", "lease_s", "epoch", "reason")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    lease_s: float
    epoch: int
    reason: str
    def __init__(self, granted: _Optional[bool] = ..., lease_s: _Optional[float] = ..., epoch: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ReportDataLossRequest(_message.Message):
    __slots__ = ("index", "server_id", "lost")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    index: int
    server_id: str
    lost: _containers.RepeatedCompositeFieldContainer[_cluster_pb2.DataLoss]
    def __init__(self, index: _Optional[int] = ..., server_id: _Optional[str] = ..., lost: _Optional[_Iterable[_Union[_cluster_pb2.DataLoss, _Mapping]]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("address", "standby", "server_id", "want_index", "health_address", "etcd_lease")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    WANT_INDEX_FIELD_NUMBER: _ClassVar[int]
    HEALTH_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ETCD_LEASE_FIELD_NUMBER: _ClassVar[int]
    address: str
    standby: bool
    server_id: str
    want_index: int
    health_address: str
    etcd_lease: int
    def __init__(self, address: _Optional[str] = ..., standby: _Optional[bool] = ..., server_id: _Optional[str] = ..., want_index: _Optional[int] = ..., health_address: _Optional[str] = ..., etcd_lease: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("map", "index", "lease_s", "server_key")
    MAP_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    SERVER_KEY_FIELD_NUMBER: _ClassVar[int]
    map: _cluster_pb2.ClusterMap
    index: int
    lease_s: float
    server_key: bytes
    def __init__(self, map: _Optional[_Union[_cluster_pb2.ClusterMap, _Mapping]] = ..., index: _Optional[int] = ..., lease_s: _Optional[float] = ..., server_key: _Optional[bytes] = ...) -> None: ...

class GetClusterMapRequest(_message.Message):
    __slots__ = ("known_epoch",)
    KNOWN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    known_epoch: int
    def __init__(self, known_epoch: _Optional[int] = ...) -> None: ...

class RegisterDenseRequest(_message.Message):
    __slots__ = ("spec", "initial_value")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    INITIAL_VALUE_FIELD_NUMBER: _ClassVar[int]
    spec: _cluster_pb2.DenseSpec
    initial_value: bytes
    def __init__(self, spec: _Optional[_Union[_cluster_pb2.DenseSpec, _Mapping]] = ..., initial_value: _Optional[bytes] = ...) -> None: ...

class ReportRedundantRequest(_message.Message):
    __slots__ = ("index", "server_id", "rebuild_seconds")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    REBUILD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    index: int
    server_id: str
    rebuild_seconds: float
    def __init__(self, index: _Optional[int] = ..., server_id: _Optional[str] = ..., rebuild_seconds: _Optional[float] = ...) -> None: ...

class ReportFailureRequest(_message.Message):
    __slots__ = ("address", "detail")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    address: str
    detail: str
    def __init__(self, address: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class CoordinatorState(_message.Message):
    __slots__ = ("map", "dense", "promoting", "server_key", "restored_from")
    MAP_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    PROMOTING_FIELD_NUMBER: _ClassVar[int]
    SERVER_KEY_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FROM_FIELD_NUMBER: _ClassVar[int]
    map: _cluster_pb2.ClusterMap
    dense: _containers.RepeatedCompositeFieldContainer[RegisterDenseRequest]
    promoting: _containers.RepeatedCompositeFieldContainer[PendingPromotion]
    server_key: bytes
    restored_from: str
    def __init__(self, map: _Optional[_Union[_cluster_pb2.ClusterMap, _Mapping]] = ..., dense: _Optional[_Iterable[_Union[RegisterDenseRequest, _Mapping]]] = ..., promoting: _Optional[_Iterable[_Union[PendingPromotion, _Mapping]]] = ..., server_key: _Optional[bytes] = ..., restored_from: _Optional[str] = ...) -> None: ...

class PendingPromotion(_message.Message):
    __slots__ = ("server_id", "address", "index")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    address: str
    index: int
    def __init__(self, server_id: _Optional[str] = ..., address: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...
