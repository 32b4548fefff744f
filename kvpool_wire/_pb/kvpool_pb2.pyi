from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_OK: _ClassVar[Status]
    STATUS_INTERNAL_ERROR: _ClassVar[Status]
    STATUS_BUFFER_OVERFLOW: _ClassVar[Status]
    STATUS_SEGMENT_NOT_FOUND: _ClassVar[Status]
    STATUS_SEGMENT_ALREADY_EXISTS: _ClassVar[Status]
    STATUS_NO_SPACE: _ClassVar[Status]
    STATUS_INVALID_KEY: _ClassVar[Status]
    STATUS_INVALID_ARGUMENT: _ClassVar[Status]
    STATUS_NOT_READY: _ClassVar[Status]
    STATUS_NOT_FOUND: _ClassVar[Status]
    STATUS_ALREADY_EXISTS: _ClassVar[Status]
    STATUS_HAS_LEASE: _ClassVar[Status]
    STATUS_LEASE_EXPIRED: _ClassVar[Status]
    STATUS_TRANSFER_FAILED: _ClassVar[Status]
    STATUS_RPC_FAILED: _ClassVar[Status]
    STATUS_UNAVAILABLE: _ClassVar[Status]
    STATUS_UNKNOWN_CLIENT: _ClassVar[Status]
    STATUS_CLIENT_ALREADY_EXISTS: _ClassVar[Status]
    STATUS_PERMISSION_DENIED: _ClassVar[Status]
    STATUS_CHECKSUM_MISMATCH: _ClassVar[Status]
    STATUS_RESOURCE_EXHAUSTED: _ClassVar[Status]
    STATUS_TIMEOUT: _ClassVar[Status]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_DRAM: _ClassVar[Tier]
    TIER_SSD: _ClassVar[Tier]

class Pin(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PIN_NONE: _ClassVar[Pin]
    PIN_SOFT: _ClassVar[Pin]
    PIN_HARD: _ClassVar[Pin]

class Method(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    METHOD_UNSPECIFIED: _ClassVar[Method]
    METHOD_AUTH: _ClassVar[Method]
    METHOD_REGISTER_CLIENT: _ClassVar[Method]
    METHOD_HEARTBEAT: _ClassVar[Method]
    METHOD_MOUNT_SEGMENT: _ClassVar[Method]
    METHOD_UNMOUNT_SEGMENT: _ClassVar[Method]
    METHOD_GET_SEGMENTS: _ClassVar[Method]
    METHOD_UNREGISTER_CLIENT: _ClassVar[Method]
    METHOD_COPY_TASKS: _ClassVar[Method]
    METHOD_PUT_START: _ClassVar[Method]
    METHOD_PUT_END: _ClassVar[Method]
    METHOD_PUT_REVOKE: _ClassVar[Method]
    METHOD_GET_REPLICAS: _ClassVar[Method]
    METHOD_EXIST: _ClassVar[Method]
    METHOD_QUERY_PREFIX: _ClassVar[Method]
    METHOD_REMOVE: _ClassVar[Method]
    METHOD_REMOVE_ALL: _ClassVar[Method]
    METHOD_REMOVE_BY_REGEX: _ClassVar[Method]
    METHOD_GET_STATS: _ClassVar[Method]
    METHOD_ERROR: _ClassVar[Method]
STATUS_OK: Status
STATUS_INTERNAL_ERROR: Status
STATUS_BUFFER_OVERFLOW: Status
STATUS_SEGMENT_NOT_FOUND: Status
STATUS_SEGMENT_ALREADY_EXISTS: Status
STATUS_NO_SPACE: Status
STATUS_INVALID_KEY: Status
STATUS_INVALID_ARGUMENT: Status
STATUS_NOT_READY: Status
STATUS_NOT_FOUND: Status
STATUS_ALREADY_EXISTS: Status
STATUS_HAS_LEASE: Status
STATUS_LEASE_EXPIRED: Status
STATUS_TRANSFER_FAILED: Status
STATUS_RPC_FAILED: Status
STATUS_UNAVAILABLE: Status
STATUS_UNKNOWN_CLIENT: Status
STATUS_CLIENT_ALREADY_EXISTS: Status
STATUS_PERMISSION_DENIED: Status
STATUS_CHECKSUM_MISMATCH: Status
STATUS_RESOURCE_EXHAUSTED: Status
STATUS_TIMEOUT: Status
TIER_DRAM: Tier
TIER_SSD: Tier
PIN_NONE: Pin
PIN_SOFT: Pin
PIN_HARD: Pin
METHOD_UNSPECIFIED: Method
METHOD_AUTH: Method
METHOD_REGISTER_CLIENT: Method
METHOD_HEARTBEAT: Method
METHOD_MOUNT_SEGMENT: Method
METHOD_UNMOUNT_SEGMENT: Method
METHOD_GET_SEGMENTS: Method
METHOD_UNREGISTER_CLIENT: Method
METHOD_COPY_TASKS: Method
METHOD_PUT_START: Method
METHOD_PUT_END: Method
METHOD_PUT_REVOKE: Method
METHOD_GET_REPLICAS: Method
METHOD_EXIST: Method
METHOD_QUERY_PREFIX: Method
METHOD_REMOVE: Method
METHOD_REMOVE_ALL: Method
METHOD_REMOVE_BY_REGEX: Method
METHOD_GET_STATS: Method
METHOD_ERROR: Method

class SegmentDescriptor(_message.Message):
    __slots__ = ("segment_id", "client_id", "size_bytes", "tier", "host_id", "shm_name", "tcp_endpoint", "engine_endpoint", "ownership_proof", "engine_base_address", "file_path")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    TCP_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    OWNERSHIP_PROOF_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FILE_PATH_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    client_id: str
    size_bytes: int
    tier: Tier
    host_id: str
    shm_name: str
    tcp_endpoint: str
    engine_endpoint: str
    ownership_proof: bytes
    engine_base_address: int
    file_path: str
    def __init__(self, segment_id: _Optional[str] = ..., client_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., host_id: _Optional[str] = ..., shm_name: _Optional[str] = ..., tcp_endpoint: _Optional[str] = ..., engine_endpoint: _Optional[str] = ..., ownership_proof: _Optional[bytes] = ..., engine_base_address: _Optional[int] = ..., file_path: _Optional[str] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("segment_id", "offset", "length", "capability_expiry_ms", "capability", "put_id")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_EXPIRY_MS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    offset: int
    length: int
    capability_expiry_ms: int
    capability: bytes
    put_id: int
    def __init__(self, segment_id: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., capability_expiry_ms: _Optional[int] = ..., capability: _Optional[bytes] = ..., put_id: _Optional[int] = ...) -> None: ...

class Replicas(_message.Message):
    __slots__ = ("placements",)
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    placements: _containers.RepeatedCompositeFieldContainer[Placement]
    def __init__(self, placements: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ...) -> None: ...

class AuthRequest(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class AuthResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    def __init__(self, status: _Optional[_Union[Status, str]] = ...) -> None: ...

class RegisterClientRequest(_message.Message):
    __slots__ = ("client_id", "host_id", "hostname", "client_token", "capability_key", "partition_ticket")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_KEY_FIELD_NUMBER: _ClassVar[int]
    PARTITION_TICKET_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    host_id: str
    hostname: str
    client_token: bytes
    capability_key: bytes
    partition_ticket: bytes
    def __init__(self, client_id: _Optional[str] = ..., host_id: _Optional[str] = ..., hostname: _Optional[str] = ..., client_token: _Optional[bytes] = ..., capability_key: _Optional[bytes] = ..., partition_ticket: _Optional[bytes] = ...) -> None: ...

class PartitionEndpoint(_message.Message):
    __slots__ = ("port", "fast_port", "fast_socket", "master_pid")
    PORT_FIELD_NUMBER: _ClassVar[int]
    FAST_PORT_FIELD_NUMBER: _ClassVar[int]
    FAST_SOCKET_FIELD_NUMBER: _ClassVar[int]
    MASTER_PID_FIELD_NUMBER: _ClassVar[int]
    port: int
    fast_port: int
    fast_socket: str
    master_pid: int
    def __init__(self, port: _Optional[int] = ..., fast_port: _Optional[int] = ..., fast_socket: _Optional[str] = ..., master_pid: _Optional[int] = ...) -> None: ...

class RegisterClientResponse(_message.Message):
    __slots__ = ("status", "client_ttl_ms", "capability_key", "fast_port", "master_id", "default_lease_ttl_ms", "fast_socket", "master_pid", "client_token", "retry_after_ms", "master_clock_ms", "capability_epoch", "max_batch_keys", "partitions", "partition_ticket")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_KEY_FIELD_NUMBER: _ClassVar[int]
    FAST_PORT_FIELD_NUMBER: _ClassVar[int]
    MASTER_ID_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    FAST_SOCKET_FIELD_NUMBER: _ClassVar[int]
    MASTER_PID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    MASTER_CLOCK_MS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_KEYS_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_TICKET_FIELD_NUMBER: _ClassVar[int]
    status: Status
    client_ttl_ms: int
    capability_key: bytes
    fast_port: int
    master_id: str
    default_lease_ttl_ms: int
    fast_socket: str
    master_pid: int
    client_token: bytes
    retry_after_ms: int
    master_clock_ms: int
    capability_epoch: int
    max_batch_keys: int
    partitions: _containers.RepeatedCompositeFieldContainer[PartitionEndpoint]
    partition_ticket: bytes
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., client_ttl_ms: _Optional[int] = ..., capability_key: _Optional[bytes] = ..., fast_port: _Optional[int] = ..., master_id: _Optional[str] = ..., default_lease_ttl_ms: _Optional[int] = ..., fast_socket: _Optional[str] = ..., master_pid: _Optional[int] = ..., client_token: _Optional[bytes] = ..., retry_after_ms: _Optional[int] = ..., master_clock_ms: _Optional[int] = ..., capability_epoch: _Optional[int] = ..., max_batch_keys: _Optional[int] = ..., partitions: _Optional[_Iterable[_Union[PartitionEndpoint, _Mapping]]] = ..., partition_ticket: _Optional[bytes] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("client_id", "client_token")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    client_token: bytes
    def __init__(self, client_id: _Optional[str] = ..., client_token: _Optional[bytes] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("status", "master_clock_ms", "copy_tasks_waiting")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MASTER_CLOCK_MS_FIELD_NUMBER: _ClassVar[int]
    COPY_TASKS_WAITING_FIELD_NUMBER: _ClassVar[int]
    status: Status
    master_clock_ms: int
    copy_tasks_waiting: int
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., master_clock_ms: _Optional[int] = ..., copy_tasks_waiting: _Optional[int] = ...) -> None: ...

class UnregisterClientRequest(_message.Message):
    __slots__ = ("client_id", "client_token")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    client_token: bytes
    def __init__(self, client_id: _Optional[str] = ..., client_token: _Optional[bytes] = ...) -> None: ...

class UnregisterClientResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    def __init__(self, status: _Optional[_Union[Status, str]] = ...) -> None: ...

class MountSegmentRequest(_message.Message):
    __slots__ = ("client_id", "segment", "client_token")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    segment: SegmentDescriptor
    client_token: bytes
    def __init__(self, client_id: _Optional[str] = ..., segment: _Optional[_Union[SegmentDescriptor, _Mapping]] = ..., client_token: _Optional[bytes] = ...) -> None: ...

class MountSegmentResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    def __init__(self, status: _Optional[_Union[Status, str]] = ...) -> None: ...

class UnmountSegmentRequest(_message.Message):
    __slots__ = ("client_id", "segment_id", "client_token")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    segment_id: str
    client_token: bytes
    def __init__(self, client_id: _Optional[str] = ..., segment_id: _Optional[str] = ..., client_token: _Optional[bytes] = ...) -> None: ...

class UnmountSegmentResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    def __init__(self, status: _Optional[_Union[Status, str]] = ...) -> None: ...

class GetSegmentsRequest(_message.Message):
    __slots__ = ("segment_ids",)
    SEGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    segment_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, segment_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetSegmentsResponse(_message.Message):
    __slots__ = ("statuses", "segments")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[Status]
    segments: _containers.RepeatedCompositeFieldContainer[SegmentDescriptor]
    def __init__(self, statuses: _Optional[_Iterable[_Union[Status, str]]] = ..., segments: _Optional[_Iterable[_Union[SegmentDescriptor, _Mapping]]] = ...) -> None: ...

class PutOptions(_message.Message):
    __slots__ = ("replica_num", "preferred_segment", "prefer_same_host", "pin")
    REPLICA_NUM_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    PREFER_SAME_HOST_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    replica_num: int
    preferred_segment: str
    prefer_same_host: bool
    pin: Pin
    def __init__(self, replica_num: _Optional[int] = ..., preferred_segment: _Optional[str] = ..., prefer_same_host: bool = ..., pin: _Optional[_Union[Pin, str]] = ...) -> None: ...

class EndedLease(_message.Message):
    __slots__ = ("lease_id", "keys")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, lease_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("client_id", "keys", "sizes_bytes", "parent_keys", "options", "client_token", "ended_leases", "ended_lease_ids", "columns")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEYS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ENDED_LEASES_FIELD_NUMBER: _ClassVar[int]
    ENDED_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    sizes_bytes: _containers.RepeatedScalarFieldContainer[int]
    parent_keys: _containers.RepeatedScalarFieldContainer[bytes]
    options: PutOptions
    client_token: bytes
    ended_leases: _containers.RepeatedCompositeFieldContainer[EndedLease]
    ended_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    columns: bool
    def __init__(self, client_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., sizes_bytes: _Optional[_Iterable[int]] = ..., parent_keys: _Optional[_Iterable[bytes]] = ..., options: _Optional[_Union[PutOptions, _Mapping]] = ..., client_token: _Optional[bytes] = ..., ended_leases: _Optional[_Iterable[_Union[EndedLease, _Mapping]]] = ..., ended_lease_ids: _Optional[_Iterable[int]] = ..., columns: bool = ...) -> None: ...

class PutStartResponse(_message.Message):
    __slots__ = ("statuses", "replicas", "columns")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[Status]
    replicas: _containers.RepeatedCompositeFieldContainer[Replicas]
    columns: Columns
    def __init__(self, statuses: _Optional[_Iterable[_Union[Status, str]]] = ..., replicas: _Optional[_Iterable[_Union[Replicas, _Mapping]]] = ..., columns: _Optional[_Union[Columns, _Mapping]] = ...) -> None: ...

class Columns(_message.Message):
    __slots__ = ("segment_ids", "offsets", "capabilities", "capability_expiry_ms", "put_id", "more_keys", "more")
    SEGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_EXPIRY_MS_FIELD_NUMBER: _ClassVar[int]
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    MORE_KEYS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    segment_ids: _containers.RepeatedScalarFieldContainer[str]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    capabilities: _containers.RepeatedScalarFieldContainer[bytes]
    capability_expiry_ms: int
    put_id: int
    more_keys: _containers.RepeatedScalarFieldContainer[int]
    more: _containers.RepeatedCompositeFieldContainer[Replicas]
    def __init__(self, segment_ids: _Optional[_Iterable[str]] = ..., offsets: _Optional[_Iterable[int]] = ..., capabilities: _Optional[_Iterable[bytes]] = ..., capability_expiry_ms: _Optional[int] = ..., put_id: _Optional[int] = ..., more_keys: _Optional[_Iterable[int]] = ..., more: _Optional[_Iterable[_Union[Replicas, _Mapping]]] = ...) -> None: ...

class PutEndRequest(_message.Message):
    __slots__ = ("client_id", "keys", "checksums", "client_token")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    client_token: bytes
    def __init__(self, client_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., checksums: _Optional[_Iterable[int]] = ..., client_token: _Optional[bytes] = ...) -> None: ...

class PutEndResponse(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[Status]
    def __init__(self, statuses: _Optional[_Iterable[_Union[Status, str]]] = ...) -> None: ...

class PutRevokeRequest(_message.Message):
    __slots__ = ("client_id", "keys", "client_token")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    client_token: bytes
    def __init__(self, client_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., client_token: _Optional[bytes] = ...) -> None: ...

class PutRevokeResponse(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[Status]
    def __init__(self, statuses: _Optional[_Iterable[_Union[Status, str]]] = ...) -> None: ...

class GetReplicasRequest(_message.Message):
    __slots__ = ("client_id", "keys", "client_token", "ended_leases", "ended_lease_ids", "columns")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ENDED_LEASES_FIELD_NUMBER: _ClassVar[int]
    ENDED_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    client_token: bytes
    ended_leases: _containers.RepeatedCompositeFieldContainer[EndedLease]
    ended_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    columns: bool
    def __init__(self, client_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., client_token: _Optional[bytes] = ..., ended_leases: _Optional[_Iterable[_Union[EndedLease, _Mapping]]] = ..., ended_lease_ids: _Optional[_Iterable[int]] = ..., columns: bool = ...) -> None: ...

class GetReplicasResponse(_message.Message):
    __slots__ = ("statuses", "sizes_bytes", "replicas", "checksums", "lease_ttl_ms", "lease_id", "columns")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    SIZES_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[Status]
    sizes_bytes: _containers.RepeatedScalarFieldContainer[int]
    replicas: _containers.RepeatedCompositeFieldContainer[Replicas]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    lease_ttl_ms: int
    lease_id: int
    columns: Columns
    def __init__(self, statuses: _Optional[_Iterable[_Union[Status, str]]] = ..., sizes_bytes: _Optional[_Iterable[int]] = ..., replicas: _Optional[_Iterable[_Union[Replicas, _Mapping]]] = ..., checksums: _Optional[_Iterable[int]] = ..., lease_ttl_ms: _Optional[int] = ..., lease_id: _Optional[int] = ..., columns: _Optional[_Union[Columns, _Mapping]] = ...) -> None: ...

class ExistRequest(_message.Message):
    __slots__ = ("client_id", "keys")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, client_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExistResponse(_message.Message):
    __slots__ = ("statuses", "sizes_bytes", "tiers")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    SIZES_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[Status]
    sizes_bytes: _containers.RepeatedScalarFieldContainer[int]
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, statuses: _Optional[_Iterable[_Union[Status, str]]] = ..., sizes_bytes: _Optional[_Iterable[int]] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class QueryPrefixRequest(_message.Message):
    __slots__ = ("client_id", "keys")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, client_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class QueryPrefixResponse(_message.Message):
    __slots__ = ("status", "num_ready", "tiers")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_READY_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    num_ready: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., num_ready: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("client_id", "keys", "force", "client_token", "ended_leases", "ended_lease_ids")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ENDED_LEASES_FIELD_NUMBER: _ClassVar[int]
    ENDED_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    force: bool
    client_token: bytes
    ended_leases: _containers.RepeatedCompositeFieldContainer[EndedLease]
    ended_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, client_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., force: bool = ..., client_token: _Optional[bytes] = ..., ended_leases: _Optional[_Iterable[_Union[EndedLease, _Mapping]]] = ..., ended_lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[Status]
    def __init__(self, statuses: _Optional[_Iterable[_Union[Status, str]]] = ...) -> None: ...

class RemoveAllRequest(_message.Message):
    __slots__ = ("client_id", "force")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    force: bool
    def __init__(self, client_id: _Optional[str] = ..., force: bool = ...) -> None: ...

class RemoveAllResponse(_message.Message):
    __slots__ = ("status", "num_removed")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    status: Status
    num_removed: int
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., num_removed: _Optional[int] = ...) -> None: ...

class RemoveByRegexRequest(_message.Message):
    __slots__ = ("client_id", "pattern", "force")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PATTERN_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    pattern: str
    force: bool
    def __init__(self, client_id: _Optional[str] = ..., pattern: _Optional[str] = ..., force: bool = ...) -> None: ...

class RemoveByRegexResponse(_message.Message):
    __slots__ = ("status", "num_removed")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    status: Status
    num_removed: int
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., num_removed: _Optional[int] = ...) -> None: ...

class CopyTask(_message.Message):
    __slots__ = ("task_id", "key", "source", "target", "checksum", "start_within_ms")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    START_WITHIN_MS_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    key: bytes
    source: Placement
    target: Placement
    checksum: int
    start_within_ms: int
    def __init__(self, task_id: _Optional[int] = ..., key: _Optional[bytes] = ..., source: _Optional[_Union[Placement, _Mapping]] = ..., target: _Optional[_Union[Placement, _Mapping]] = ..., checksum: _Optional[int] = ..., start_within_ms: _Optional[int] = ...) -> None: ...

class CopyResult(_message.Message):
    __slots__ = ("task_id", "status")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    status: Status
    def __init__(self, task_id: _Optional[int] = ..., status: _Optional[_Union[Status, str]] = ...) -> None: ...

class CopyTasksRequest(_message.Message):
    __slots__ = ("client_id", "client_token", "done", "max_tasks", "wait_ms")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    MAX_TASKS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    client_token: bytes
    done: _containers.RepeatedCompositeFieldContainer[CopyResult]
    max_tasks: int
    wait_ms: int
    def __init__(self, client_id: _Optional[str] = ..., client_token: _Optional[bytes] = ..., done: _Optional[_Iterable[_Union[CopyResult, _Mapping]]] = ..., max_tasks: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class CopyTasksResponse(_message.Message):
    __slots__ = ("status", "tasks")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    tasks: _containers.RepeatedCompositeFieldContainer[CopyTask]
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., tasks: _Optional[_Iterable[_Union[CopyTask, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("status", "json")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    status: Status
    json: str
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., json: _Optional[str] = ...) -> None: ...
