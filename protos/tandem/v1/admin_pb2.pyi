# Post-processed by protos/generate.py (grpcio-tools 1.85.1)
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_READY: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_DEAD: _ClassVar[WorkerState]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_READY: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_DEAD: WorkerState

class GetClusterStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Worker(_message.Message):
    __slots__ = ("id", "pool", "pid", "node", "state", "running_requests", "waiting_requests", "kv_blocks_used", "kv_blocks_total", "role", "host", "sequences_migrated", "kv_tokens_migrated", "sequences_migrated_in", "pressure_moves", "tokens_recomputed", "kv_tokens_precopied", "move_precopy_seconds", "move_tail_seconds", "migrations_resumed")
    ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_MIGRATED_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_MIGRATED_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_MIGRATED_IN_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_MOVES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_PRECOPIED_FIELD_NUMBER: _ClassVar[int]
    MOVE_PRECOPY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MOVE_TAIL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_RESUMED_FIELD_NUMBER: _ClassVar[int]
    id: str
    pool: str
    pid: int
    node: str
    state: WorkerState
    running_requests: int
    waiting_requests: int
    kv_blocks_used: int
    kv_blocks_total: int
    role: str
    host: str
    sequences_migrated: int
    kv_tokens_migrated: int
    sequences_migrated_in: int
    pressure_moves: int
    tokens_recomputed: int
    kv_tokens_precopied: int
    move_precopy_seconds: float
    move_tail_seconds: float
    migrations_resumed: int
    def __init__(self, id: _Optional[str] = ..., pool: _Optional[str] = ..., pid: _Optional[int] = ..., node: _Optional[str] = ..., state: _Optional[_Union[WorkerState, str]] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., role: _Optional[str] = ..., host: _Optional[str] = ..., sequences_migrated: _Optional[int] = ..., kv_tokens_migrated: _Optional[int] = ..., sequences_migrated_in: _Optional[int] = ..., pressure_moves: _Optional[int] = ..., tokens_recomputed: _Optional[int] = ..., kv_tokens_precopied: _Optional[int] = ..., move_precopy_seconds: _Optional[float] = ..., move_tail_seconds: _Optional[float] = ..., migrations_resumed: _Optional[int] = ...) -> None: ...

class Pool(_message.Message):
    __slots__ = ("name", "size", "target", "min", "max", "draining", "workers", "target_pinned")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TARGET_PINNED_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    target: int
    min: int
    max: int
    draining: int
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    target_pinned: bool
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., target: _Optional[int] = ..., min: _Optional[int] = ..., max: _Optional[int] = ..., draining: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ..., target_pinned: _Optional[bool] = ...) -> None: ...

class ClusterTotals(_message.Message):
    __slots__ = ("workers", "running_requests", "waiting_requests", "kv_blocks_used", "kv_blocks_total")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    workers: int
    running_requests: int
    waiting_requests: int
    kv_blocks_used: int
    kv_blocks_total: int
    def __init__(self, workers: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ...) -> None: ...

class AutoscalerDecision(_message.Message):
    __slots__ = ("at_unix_s", "prefill_target", "decode_target", "reasons")
    AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TARGET_FIELD_NUMBER: _ClassVar[int]
    DECODE_TARGET_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    at_unix_s: float
    prefill_target: int
    decode_target: int
    reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, at_unix_s: _Optional[float] = ..., prefill_target: _Optional[int] = ..., decode_target: _Optional[int] = ..., reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class RoleChange(_message.Message):
    __slots__ = ("at_unix_s", "worker_id", "pool", "from_role", "to_role", "reason", "took_s")
    AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    FROM_ROLE_FIELD_NUMBER: _ClassVar[int]
    TO_ROLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TOOK_S_FIELD_NUMBER: _ClassVar[int]
    at_unix_s: float
    worker_id: str
    pool: str
    from_role: str
    to_role: str
    reason: str
    took_s: float
    def __init__(self, at_unix_s: _Optional[float] = ..., worker_id: _Optional[str] = ..., pool: _Optional[str] = ..., from_role: _Optional[str] = ..., to_role: _Optional[str] = ..., reason: _Optional[str] = ..., took_s: _Optional[float] = ...) -> None: ...

class ClusterState(_message.Message):
    __slots__ = ("pools", "totals", "last_decision", "role_changes")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    LAST_DECISION_FIELD_NUMBER: _ClassVar[int]
    ROLE_CHANGES_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[Pool]
    totals: ClusterTotals
    last_decision: AutoscalerDecision
    role_changes: _containers.RepeatedCompositeFieldContainer[RoleChange]
    def __init__(self, pools: _Optional[_Iterable[_Union[Pool, _Mapping]]] = ..., totals: _Optional[_Union[ClusterTotals, _Mapping]] = ..., last_decision: _Optional[_Union[AutoscalerDecision, _Mapping]] = ..., role_changes: _Optional[_Iterable[_Union[RoleChange, _Mapping]]] = ...) -> None: ...

class SetPoolBoundsRequest(_message.Message):
    __slots__ = ("pool", "min", "max", "target")
    POOL_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    pool: str
    min: int
    max: int
    target: int
    def __init__(self, pool: _Optional[str] = ..., min: _Optional[int] = ..., max: _Optional[int] = ..., target: _Optional[int] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "finish_in_place")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    finish_in_place: bool
    def __init__(self, worker_id: _Optional[str] = ..., finish_in_place: _Optional[bool] = ...) -> None: ...

class MoveSequencesRequest(_message.Message):
    __slots__ = ("worker_id", "count")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    count: int
    def __init__(self, worker_id: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class MoveSequencesResponse(_message.Message):
    __slots__ = ("paused",)
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    paused: int
    def __init__(self, paused: _Optional[int] = ...) -> None: ...

class SetWorkerRoleRequest(_message.Message):
    __slots__ = ("worker_id", "role", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
