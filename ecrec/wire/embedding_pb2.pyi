from ecrec.wire import cluster_pb2 as _cluster_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Assign(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRADIENT: _ClassVar[Assign]
    WEIGHTS: _ClassVar[Assign]
    PAYLOAD: _ClassVar[Assign]
    STATE: _ClassVar[Assign]
GRADIENT: Assign
WEIGHTS: Assign
PAYLOAD: Assign
STATE: Assign

class Ack(_message.Message):
    __slots__ = ("epoch", "recovering", "index")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RECOVERING_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    recovering: bool
    index: int
    def __init__(self, epoch: _Optional[int] = ..., recovering: _Optional[bool] = ..., index: _Optional[int] = ...) -> None: ...

class PushId(_message.Message):
    __slots__ = ("worker", "sequence", "incarnation")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker: str
    sequence: int
    incarnation: str
    def __init__(self, worker: _Optional[str] = ..., sequence: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class TableIds(_message.Message):
    __slots__ = ("table", "ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ...) -> None: ...

class RelayBatch(_message.Message):
    __slots__ = ("destination", "destination_id", "batch", "mac")
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    destination: int
    destination_id: str
    batch: bytes
    mac: bytes
    def __init__(self, destination: _Optional[int] = ..., destination_id: _Optional[str] = ..., batch: _Optional[bytes] = ..., mac: _Optional[bytes] = ...) -> None: ...

class ParityWatermark(_message.Message):
    __slots__ = ("source", "source_id", "destination", "destination_id", "applied_upto", "mac")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_ID_FIELD_NUMBER: _ClassVar[int]
    APPLIED_UPTO_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    source: int
    source_id: str
    destination: int
    destination_id: str
    applied_upto: int
    mac: bytes
    def __init__(self, source: _Optional[int] = ..., source_id: _Optional[str] = ..., destination: _Optional[int] = ..., destination_id: _Optional[str] = ..., applied_upto: _Optional[int] = ..., mac: _Optional[bytes] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("tables", "dense", "epoch", "relay")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableIds]
    dense: _containers.RepeatedScalarFieldContainer[str]
    epoch: int
    relay: _containers.RepeatedCompositeFieldContainer[RelayBatch]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableIds, _Mapping]]] = ..., dense: _Optional[_Iterable[str]] = ..., epoch: _Optional[int] = ..., relay: _Optional[_Iterable[_Union[RelayBatch, _Mapping]]] = ...) -> None: ...

class PullReply(_message.Message):
    __slots__ = ("values", "dense", "watermarks", "confirmed_upto", "server_id")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    WATERMARKS_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_UPTO_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    dense: _containers.RepeatedCompositeFieldContainer[DenseValue]
    watermarks: _containers.RepeatedCompositeFieldContainer[ParityWatermark]
    confirmed_upto: int
    server_id: str
    def __init__(self, values: _Optional[_Iterable[bytes]] = ..., dense: _Optional[_Iterable[_Union[DenseValue, _Mapping]]] = ..., watermarks: _Optional[_Iterable[_Union[ParityWatermark, _Mapping]]] = ..., confirmed_upto: _Optional[int] = ..., server_id: _Optional[str] = ...) -> None: ...

class TableGrads(_message.Message):
    __slots__ = ("table", "ids", "grads", "assign")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    grads: bytes
    assign: Assign
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., grads: _Optional[bytes] = ..., assign: _Optional[_Union[Assign, str]] = ...) -> None: ...

class DenseValue(_message.Message):
    __slots__ = ("name", "value", "assign")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: bytes
    assign: Assign
    def __init__(self, name: _Optional[str] = ..., value: _Optional[bytes] = ..., assign: _Optional[_Union[Assign, str]] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("tables", "dense", "push_id", "epoch", "return_dense", "relay", "acks", "replay", "parts")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RETURN_DENSE_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableGrads]
    dense: _containers.RepeatedCompositeFieldContainer[DenseValue]
    push_id: PushId
    epoch: int
    return_dense: bool
    relay: _containers.RepeatedCompositeFieldContainer[RelayBatch]
    acks: _containers.RepeatedCompositeFieldContainer[ParityWatermark]
    replay: bool
    parts: int
    def __init__(self, tables: _Optional[_Iterable[_Union[TableGrads, _Mapping]]] = ..., dense: _Optional[_Iterable[_Union[DenseValue, _Mapping]]] = ..., push_id: _Optional[_Union[PushId, _Mapping]] = ..., epoch: _Optional[int] = ..., return_dense: _Optional[bool] = ..., relay: _Optional[_Iterable[_Union[RelayBatch, _Mapping]]] = ..., acks: _Optional[_Iterable[_Union[ParityWatermark, _Mapping]]] = ..., replay: _Optional[bool] = ..., parts: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("already_applied", "rows_updated", "dense", "relay", "seq", "confirmed_upto", "server_id", "watermarks")
    ALREADY_APPLIED_FIELD_NUMBER: _ClassVar[int]
    ROWS_UPDATED_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_UPTO_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    WATERMARKS_FIELD_NUMBER: _ClassVar[int]
    already_applied: bool
    rows_updated: int
    dense: _containers.RepeatedCompositeFieldContainer[DenseValue]
    relay: _containers.RepeatedCompositeFieldContainer[RelayBatch]
    seq: int
    confirmed_upto: int
    server_id: str
    watermarks: _containers.RepeatedCompositeFieldContainer[ParityWatermark]
    def __init__(self, already_applied: _Optional[bool] = ..., rows_updated: _Optional[int] = ..., dense: _Optional[_Iterable[_Union[DenseValue, _Mapping]]] = ..., relay: _Optional[_Iterable[_Union[RelayBatch, _Mapping]]] = ..., seq: _Optional[int] = ..., confirmed_upto: _Optional[int] = ..., server_id: _Optional[str] = ..., watermarks: _Optional[_Iterable[_Union[ParityWatermark, _Mapping]]] = ...) -> None: ...

class ReplayRequest(_message.Message):
    __slots__ = ("pushes",)
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    pushes: _containers.RepeatedCompositeFieldContainer[PushRequest]
    def __init__(self, pushes: _Optional[_Iterable[_Union[PushRequest, _Mapping]]] = ...) -> None: ...

class ReplayReply(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[PushReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[PushReply, _Mapping]]] = ...) -> None: ...

class PromoteRequest(_message.Message):
    __slots__ = ("index", "map", "dense")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MAP_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    index: int
    map: _cluster_pb2.ClusterMap
    dense: _containers.RepeatedCompositeFieldContainer[CreateDenseRequest]
    def __init__(self, index: _Optional[int] = ..., map: _Optional[_Union[_cluster_pb2.ClusterMap, _Mapping]] = ..., dense: _Optional[_Iterable[_Union[CreateDenseRequest, _Mapping]]] = ...) -> None: ...

class CreateDenseRequest(_message.Message):
    __slots__ = ("spec", "initial_value")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    INITIAL_VALUE_FIELD_NUMBER: _ClassVar[int]
    spec: _cluster_pb2.DenseSpec
    initial_value: bytes
    def __init__(self, spec: _Optional[_Union[_cluster_pb2.DenseSpec, _Mapping]] = ..., initial_value: _Optional[bytes] = ...) -> None: ...

class ReadPayloadRequest(_message.Message):
    __slots__ = ("table", "ids", "all_rows", "dense", "cut", "deliver_port", "ticket")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ALL_ROWS_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    DELIVER_PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    all_rows: bool
    dense: _containers.RepeatedScalarFieldContainer[str]
    cut: str
    deliver_port: int
    ticket: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., all_rows: _Optional[bool] = ..., dense: _Optional[_Iterable[str]] = ..., cut: _Optional[str] = ..., deliver_port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class ReadPayloadReply(_message.Message):
    __slots__ = ("ids", "payload", "row_bytes", "dense")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    payload: bytes
    row_bytes: int
    dense: _containers.RepeatedCompositeFieldContainer[DenseValue]
    def __init__(self, ids: _Optional[bytes] = ..., payload: _Optional[bytes] = ..., row_bytes: _Optional[int] = ..., dense: _Optional[_Iterable[_Union[DenseValue, _Mapping]]] = ...) -> None: ...

class SnapshotRange(_message.Message):
    __slots__ = ("table", "start", "stop")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    table: str
    start: int
    stop: int
    def __init__(self, table: _Optional[str] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class WriteSnapshotRequest(_message.Message):
    __slots__ = ("path", "file", "ranges", "dense", "chunk_bytes", "cut")
    PATH_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    path: str
    file: str
    ranges: _containers.RepeatedCompositeFieldContainer[SnapshotRange]
    dense: _containers.RepeatedScalarFieldContainer[str]
    chunk_bytes: int
    cut: str
    def __init__(self, path: _Optional[str] = ..., file: _Optional[str] = ..., ranges: _Optional[_Iterable[_Union[SnapshotRange, _Mapping]]] = ..., dense: _Optional[_Iterable[str]] = ..., chunk_bytes: _Optional[int] = ..., cut: _Optional[str] = ...) -> None: ...

class WriteSnapshotReply(_message.Message):
    __slots__ = ("items_json", "bytes", "seconds", "parts_json")
    ITEMS_JSON_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PARTS_JSON_FIELD_NUMBER: _ClassVar[int]
    items_json: str
    bytes: int
    seconds: float
    parts_json: str
    def __init__(self, items_json: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., parts_json: _Optional[str] = ...) -> None: ...

class RestoreTableRequest(_message.Message):
    __slots__ = ("step", "table", "path", "source_json")
    class Step(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS: _ClassVar[RestoreTableRequest.Step]
        BEGIN: _ClassVar[RestoreTableRequest.Step]
        FILL: _ClassVar[RestoreTableRequest.Step]
        FINISH: _ClassVar[RestoreTableRequest.Step]
        ABORT: _ClassVar[RestoreTableRequest.Step]
    STATUS: RestoreTableRequest.Step
    BEGIN: RestoreTableRequest.Step
    FILL: RestoreTableRequest.Step
    FINISH: RestoreTableRequest.Step
    ABORT: RestoreTableRequest.Step
    STEP_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_JSON_FIELD_NUMBER: _ClassVar[int]
    step: RestoreTableRequest.Step
    table: str
    path: str
    source_json: str
    def __init__(self, step: _Optional[_Union[RestoreTableRequest.Step, str]] = ..., table: _Optional[str] = ..., path: _Optional[str] = ..., source_json: _Optional[str] = ...) -> None: ...

class RestoreTableReply(_message.Message):
    __slots__ = ("state", "source", "seconds", "parts_json", "rewritten")
    STATE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PARTS_JSON_FIELD_NUMBER: _ClassVar[int]
    REWRITTEN_FIELD_NUMBER: _ClassVar[int]
    state: str
    source: str
    seconds: float
    parts_json: str
    rewritten: bool
    def __init__(self, state: _Optional[str] = ..., source: _Optional[str] = ..., seconds: _Optional[float] = ..., parts_json: _Optional[str] = ..., rewritten: _Optional[bool] = ...) -> None: ...

class HoldPushesRequest(_message.Message):
    __slots__ = ("holder", "hold_s", "admit", "mark_cut", "cut_ttl_s", "drop_cut", "max_age_s")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    MARK_CUT_FIELD_NUMBER: _ClassVar[int]
    CUT_TTL_S_FIELD_NUMBER: _ClassVar[int]
    DROP_CUT_FIELD_NUMBER: _ClassVar[int]
    MAX_AGE_S_FIELD_NUMBER: _ClassVar[int]
    holder: str
    hold_s: float
    admit: _containers.RepeatedCompositeFieldContainer[PushMark]
    mark_cut: bool
    cut_ttl_s: float
    drop_cut: bool
    max_age_s: float
    def __init__(self, holder: _Optional[str] = ..., hold_s: _Optional[float] = ..., admit: _Optional[_Iterable[_Union[PushMark, _Mapping]]] = ..., mark_cut: _Optional[bool] = ..., cut_ttl_s: _Optional[float] = ..., drop_cut: _Optional[bool] = ..., max_age_s: _Optional[float] = ...) -> None: ...

class PushMark(_message.Message):
    __slots__ = ("worker", "sequence", "parts", "age_s", "refused")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    worker: str
    sequence: int
    parts: int
    age_s: float
    refused: bool
    def __init__(self, worker: _Optional[str] = ..., sequence: _Optional[int] = ..., parts: _Optional[int] = ..., age_s: _Optional[float] = ..., refused: _Optional[bool] = ...) -> None: ...

class HoldPushesReply(_message.Message):
    __slots__ = ("marks", "held_throughout", "server_id")
    MARKS_FIELD_NUMBER: _ClassVar[int]
    HELD_THROUGHOUT_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    marks: _containers.RepeatedCompositeFieldContainer[PushMark]
    held_throughout: bool
    server_id: str
    def __init__(self, marks: _Optional[_Iterable[_Union[PushMark, _Mapping]]] = ..., held_throughout: _Optional[bool] = ..., server_id: _Optional[str] = ...) -> None: ...

class StrategyCallRequest(_message.Message):
    __slots__ = ("command", "args_json")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    command: str
    args_json: str
    def __init__(self, command: _Optional[str] = ..., args_json: _Optional[str] = ...) -> None: ...

class StrategyCallReply(_message.Message):
    __slots__ = ("result_json",)
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    result_json: str
    def __init__(self, result_json: _Optional[str] = ...) -> None: ...

class EchoMessage(_message.Message):
    __slots__ = ("data", "reply_bytes")
    DATA_FIELD_NUMBER: _ClassVar[int]
    REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    reply_bytes: int
    def __init__(self, data: _Optional[bytes] = ..., reply_bytes: _Optional[int] = ...) -> None: ...
