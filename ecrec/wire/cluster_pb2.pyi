from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ServerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVER_STATE_UNSPECIFIED: _ClassVar[ServerState]
    ACTIVE: _ClassVar[ServerState]
    STANDBY: _ClassVar[ServerState]
    FAILED: _ClassVar[ServerState]
    RECOVERING: _ClassVar[ServerState]
    PROMOTING: _ClassVar[ServerState]
SERVER_STATE_UNSPECIFIED: ServerState
ACTIVE: ServerState
STANDBY: ServerState
FAILED: ServerState
RECOVERING: ServerState
PROMOTING: ServerState

class TableSpec(_message.Message):
    __slots__ = ("name", "num_rows", "dim", "optimizer", "lr", "eps", "initial_accumulator_value", "init", "init_scale", "seed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_VALUE_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    INIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_rows: int
    dim: int
    optimizer: str
    lr: float
    eps: float
    initial_accumulator_value: float
    init: str
    init_scale: float
    seed: int
    def __init__(self, name: _Optional[str] = ..., num_rows: _Optional[int] = ..., dim: _Optional[int] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., eps: _Optional[float] = ..., initial_accumulator_value: _Optional[float] = ..., init: _Optional[str] = ..., init_scale: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class DenseSpec(_message.Message):
    __slots__ = ("name", "shape", "optimizer", "lr", "eps", "initial_accumulator_value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    optimizer: str
    lr: float
    eps: float
    initial_accumulator_value: float
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., eps: _Optional[float] = ..., initial_accumulator_value: _Optional[float] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("index", "address", "state", "server_id", "health_address")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    HEALTH_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    index: int
    address: str
    state: ServerState
    server_id: str
    health_address: str
    def __init__(self, index: _Optional[int] = ..., address: _Optional[str] = ..., state: _Optional[_Union[ServerState, str]] = ..., server_id: _Optional[str] = ..., health_address: _Optional[str] = ...) -> None: ...

class ClusterMap(_message.Message):
    __slots__ = ("epoch", "num_servers", "strategy", "strategy_options", "k", "m", "servers", "tables", "dense", "ready", "events", "data_loss", "lease_store", "lease_s")
    class StrategyOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_SERVERS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    M_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DATA_LOSS_FIELD_NUMBER: _ClassVar[int]
    LEASE_STORE_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    num_servers: int
    strategy: str
    strategy_options: _containers.ScalarMap[str, str]
    k: int
    m: int
    servers: _containers.RepeatedCompositeFieldContainer[ServerInfo]
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    dense: _containers.RepeatedCompositeFieldContainer[DenseSpec]
    ready: bool
    events: _containers.RepeatedCompositeFieldContainer[ClusterEvent]
    data_loss: _containers.RepeatedCompositeFieldContainer[DataLoss]
    lease_store: str
    lease_s: float
    def __init__(self, epoch: _Optional[int] = ..., num_servers: _Optional[int] = ..., strategy: _Optional[str] = ..., strategy_options: _Optional[_Mapping[str, str]] = ..., k: _Optional[int] = ..., m: _Optional[int] = ..., servers: _Optional[_Iterable[_Union[ServerInfo, _Mapping]]] = ..., tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ..., dense: _Optional[_Iterable[_Union[DenseSpec, _Mapping]]] = ..., ready: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[ClusterEvent, _Mapping]]] = ..., data_loss: _Optional[_Iterable[_Union[DataLoss, _Mapping]]] = ..., lease_store: _Optional[str] = ..., lease_s: _Optional[float] = ...) -> None: ...

class DataLoss(_message.Message):
    __slots__ = ("table", "stripes", "stripe_count", "indices", "wall_time")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    STRIPES_FIELD_NUMBER: _ClassVar[int]
    STRIPE_COUNT_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_FIELD_NUMBER: _ClassVar[int]
    table: str
    stripes: _containers.RepeatedScalarFieldContainer[int]
    stripe_count: int
    indices: _containers.RepeatedScalarFieldContainer[int]
    wall_time: float
    def __init__(self, table: _Optional[str] = ..., stripes: _Optional[_Iterable[int]] = ..., stripe_count: _Optional[int] = ..., indices: _Optional[_Iterable[int]] = ..., wall_time: _Optional[float] = ...) -> None: ...

class ClusterEvent(_message.Message):
    __slots__ = ("kind", "index", "address", "wall_time", "epoch")
    KIND_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    kind: str
    index: int
    address: str
    wall_time: float
    epoch: int
    def __init__(self, kind: _Optional[str] = ..., index: _Optional[int] = ..., address: _Optional[str] = ..., wall_time: _Optional[float] = ..., epoch: _Optional[int] = ...) -> None: ...
