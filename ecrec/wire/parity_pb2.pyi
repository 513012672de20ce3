from ecrec.wire import embedding_pb2 as _embedding_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ParityBatch(_message.Message):
    __slots__ = ("source", "source_id", "seq", "push_id", "first_seq", "push_ids", "destinations", "tables", "dense", "destination_ids", "destination", "destination_id", "prev_seq", "confirmed_upto")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    PUSH_IDS_FIELD_NUMBER: _ClassVar[int]
    DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_IDS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_ID_FIELD_NUMBER: _ClassVar[int]
    PREV_SEQ_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_UPTO_FIELD_NUMBER: _ClassVar[int]
    source: int
    source_id: str
    seq: int
    push_id: _embedding_pb2.PushId
    first_seq: int
    push_ids: _containers.RepeatedCompositeFieldContainer[_embedding_pb2.PushId]
    destinations: _containers.RepeatedScalarFieldContainer[int]
    tables: _containers.RepeatedCompositeFieldContainer[ParityDeltas]
    dense: _containers.RepeatedCompositeFieldContainer[DenseDelta]
    destination_ids: _containers.RepeatedScalarFieldContainer[str]
    destination: int
    destination_id: str
    prev_seq: int
    confirmed_upto: int
    def __init__(self, source: _Optional[int] = ..., source_id: _Optional[str] = ..., seq: _Optional[int] = ..., push_id: _Optional[_Union[_embedding_pb2.PushId, _Mapping]] = ..., first_seq: _Optional[int] = ..., push_ids: _Optional[_Iterable[_Union[_embedding_pb2.PushId, _Mapping]]] = ..., destinations: _Optional[_Iterable[int]] = ..., tables: _Optional[_Iterable[_Union[ParityDeltas, _Mapping]]] = ..., dense: _Optional[_Iterable[_Union[DenseDelta, _Mapping]]] = ..., destination_ids: _Optional[_Iterable[str]] = ..., destination: _Optional[int] = ..., destination_id: _Optional[str] = ..., prev_seq: _Optional[int] = ..., confirmed_upto: _Optional[int] = ...) -> None: ...

class ParityDeltas(_message.Message):
    __slots__ = ("tables", "table_rows", "parity_slots", "positions", "parity", "deltas", "old_versions", "seqs")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    TABLE_ROWS_FIELD_NUMBER: _ClassVar[int]
    PARITY_SLOTS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    PARITY_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    OLD_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedScalarFieldContainer[str]
    table_rows: bytes
    parity_slots: bytes
    positions: bytes
    parity: int
    deltas: bytes
    old_versions: bytes
    seqs: bytes
    def __init__(self, tables: _Optional[_Iterable[str]] = ..., table_rows: _Optional[bytes] = ..., parity_slots: _Optional[bytes] = ..., positions: _Optional[bytes] = ..., parity: _Optional[int] = ..., deltas: _Optional[bytes] = ..., old_versions: _Optional[bytes] = ..., seqs: _Optional[bytes] = ...) -> None: ...

class DenseDelta(_message.Message):
    __slots__ = ("name", "value", "old_version", "seq")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    OLD_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: bytes
    old_version: int
    seq: int
    def __init__(self, name: _Optional[str] = ..., value: _Optional[bytes] = ..., old_version: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class ParityBatches(_message.Message):
    __slots__ = ("batches", "sealed", "source", "source_id", "confirmed_upto")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_UPTO_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[ParityBatch]
    sealed: _containers.RepeatedCompositeFieldContainer[_embedding_pb2.RelayBatch]
    source: int
    source_id: str
    confirmed_upto: int
    def __init__(self, batches: _Optional[_Iterable[_Union[ParityBatch, _Mapping]]] = ..., sealed: _Optional[_Iterable[_Union[_embedding_pb2.RelayBatch, _Mapping]]] = ..., source: _Optional[int] = ..., source_id: _Optional[str] = ..., confirmed_upto: _Optional[int] = ...) -> None: ...

class ParityAck(_message.Message):
    __slots__ = ("applied_upto", "destination_id")
    APPLIED_UPTO_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_ID_FIELD_NUMBER: _ClassVar[int]
    applied_upto: int
    destination_id: str
    def __init__(self, applied_upto: _Optional[int] = ..., destination_id: _Optional[str] = ...) -> None: ...

class OpenParityChannelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenParityChannelReply(_message.Message):
    __slots__ = ("port", "ticket")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    port: int
    ticket: bytes
    def __init__(self, port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class FlushReply(_message.Message):
    __slots__ = ("unconfirmed",)
    UNCONFIRMED_FIELD_NUMBER: _ClassVar[int]
    unconfirmed: int
    def __init__(self, unconfirmed: _Optional[int] = ...) -> None: ...

class ResolveSourceRequest(_message.Message):
    __slots__ = ("source", "commit", "undo_seqs", "replacement_id")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    UNDO_SEQS_FIELD_NUMBER: _ClassVar[int]
    REPLACEMENT_ID_FIELD_NUMBER: _ClassVar[int]
    source: int
    commit: bool
    undo_seqs: _containers.RepeatedScalarFieldContainer[int]
    replacement_id: str
    def __init__(self, source: _Optional[int] = ..., commit: _Optional[bool] = ..., undo_seqs: _Optional[_Iterable[int]] = ..., replacement_id: _Optional[str] = ...) -> None: ...

class LoggedPush(_message.Message):
    __slots__ = ("seq", "push_id", "destinations", "destination_ids", "first_seq", "push_ids")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    PUSH_IDS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    push_id: _embedding_pb2.PushId
    destinations: _containers.RepeatedScalarFieldContainer[int]
    destination_ids: _containers.RepeatedScalarFieldContainer[str]
    first_seq: int
    push_ids: _containers.RepeatedCompositeFieldContainer[_embedding_pb2.PushId]
    def __init__(self, seq: _Optional[int] = ..., push_id: _Optional[_Union[_embedding_pb2.PushId, _Mapping]] = ..., destinations: _Optional[_Iterable[int]] = ..., destination_ids: _Optional[_Iterable[str]] = ..., first_seq: _Optional[int] = ..., push_ids: _Optional[_Iterable[_Union[_embedding_pb2.PushId, _Mapping]]] = ...) -> None: ...

class ResolveSourceReply(_message.Message):
    __slots__ = ("logged", "confirmed_upto", "committed")
    LOGGED_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_UPTO_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    logged: _containers.RepeatedCompositeFieldContainer[LoggedPush]
    confirmed_upto: int
    committed: _containers.RepeatedCompositeFieldContainer[_embedding_pb2.PushId]
    def __init__(self, logged: _Optional[_Iterable[_Union[LoggedPush, _Mapping]]] = ..., confirmed_upto: _Optional[int] = ..., committed: _Optional[_Iterable[_Union[_embedding_pb2.PushId, _Mapping]]] = ...) -> None: ...

class ReadRowsRequest(_message.Message):
    __slots__ = ("table", "ids", "stripes", "parity_index", "dense", "sections", "confirmed")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    STRIPES_FIELD_NUMBER: _ClassVar[int]
    PARITY_INDEX_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    SECTIONS_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    stripes: bytes
    parity_index: bytes
    dense: str
    sections: _containers.RepeatedCompositeFieldContainer[ReadRowsRequest]
    confirmed: bool
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., stripes: _Optional[bytes] = ..., parity_index: _Optional[bytes] = ..., dense: _Optional[str] = ..., sections: _Optional[_Iterable[_Union[ReadRowsRequest, _Mapping]]] = ..., confirmed: _Optional[bool] = ...) -> None: ...

class ReadRowsReply(_message.Message):
    __slots__ = ("payload", "versions", "ready", "sections", "confirmed_upto", "committed", "server_id")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    SECTIONS_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_UPTO_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    versions: bytes
    ready: bytes
    sections: _containers.RepeatedCompositeFieldContainer[ReadRowsReply]
    confirmed_upto: int
    committed: _containers.RepeatedCompositeFieldContainer[_embedding_pb2.PushId]
    server_id: str
    def __init__(self, payload: _Optional[bytes] = ..., versions: _Optional[bytes] = ..., ready: _Optional[bytes] = ..., sections: _Optional[_Iterable[_Union[ReadRowsReply, _Mapping]]] = ..., confirmed_upto: _Optional[int] = ..., committed: _Optional[_Iterable[_Union[_embedding_pb2.PushId, _Mapping]]] = ..., server_id: _Optional[str] = ...) -> None: ...

class StreamStripesRequest(_message.Message):
    __slots__ = ("table", "first_block", "end_block", "data_positions", "parity_indices", "blocks_per_message", "deliver_port", "ticket")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DATA_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    PARITY_INDICES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DELIVER_PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    table: str
    first_block: int
    end_block: int
    data_positions: _containers.RepeatedScalarFieldContainer[int]
    parity_indices: _containers.RepeatedScalarFieldContainer[int]
    blocks_per_message: int
    deliver_port: int
    ticket: bytes
    def __init__(self, table: _Optional[str] = ..., first_block: _Optional[int] = ..., end_block: _Optional[int] = ..., data_positions: _Optional[_Iterable[int]] = ..., parity_indices: _Optional[_Iterable[int]] = ..., blocks_per_message: _Optional[int] = ..., deliver_port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...
