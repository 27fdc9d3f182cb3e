"""etcd v3's gRPC messages (the subset the master uses) in a private descriptor pool.

The field numbers are etcd's (``api/etcdserverpb/rpc.proto``, ``api/mvccpb/kv.proto``); the
messages are declared here in Python rather than generated, into a pool of their own, so:
nothing lands in protobuf's default pool (two etcd clients in one process clash there on
``etcdserverpb.*`` and on the file name ``kv.proto``), no generated code has to match the
protobuf runtime, and no grpcio-tools is needed to build or install.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto
_T = {"bytes": _F.TYPE_BYTES, "string": _F.TYPE_STRING, "int64": _F.TYPE_INT64, "uint64": _F.TYPE_UINT64,
      "bool": _F.TYPE_BOOL, "uint32": _F.TYPE_UINT32}

# (message name, [(field name, number, type, repeated, oneof index or None)]); a type not in
# _T is a message or enum type name, fully qualified.
_KV = [
    ("KeyValue", [("key", 1, "bytes"), ("create_revision", 2, "int64"), ("mod_revision", 3, "int64"),
                  ("version", 4, "int64"), ("value", 5, "bytes"), ("lease", 6, "int64")]),
    ("Event", [("type", 1, "enum:.mvccpb.Event.EventType"), ("kv", 2, ".mvccpb.KeyValue"),
               ("prev_kv", 3, ".mvccpb.KeyValue")]),
]
_H = ("header", 1, ".etcdserverpb.ResponseHeader")
_RPC = [
    ("ResponseHeader", [("cluster_id", 1, "uint64"), ("member_id", 2, "uint64"), ("revision", 3, "int64"),
                        ("raft_term", 4, "uint64")]),
    ("RangeRequest", [("key", 1, "bytes"), ("range_end", 2, "bytes"), ("limit", 3, "int64"),
                      ("revision", 4, "int64"), ("serializable", 7, "bool"), ("keys_only", 8, "bool"),
                      ("count_only", 9, "bool")]),
    ("RangeResponse", [_H, ("kvs", 2, "*.mvccpb.KeyValue"), ("more", 3, "bool"), ("count", 4, "int64")]),
    ("PutRequest", [("key", 1, "bytes"), ("value", 2, "bytes"), ("lease", 3, "int64"), ("prev_kv", 4, "bool"),
                    ("ignore_value", 5, "bool"), ("ignore_lease", 6, "bool")]),
    ("PutResponse", [_H, ("prev_kv", 2, ".mvccpb.KeyValue")]),
    ("DeleteRangeRequest", [("key", 1, "bytes"), ("range_end", 2, "bytes"), ("prev_kv", 3, "bool")]),
    ("DeleteRangeResponse", [_H, ("deleted", 2, "int64"), ("prev_kvs", 3, "*.mvccpb.KeyValue")]),
    ("RequestOp", [("request_range", 1, ".etcdserverpb.RangeRequest", 0),
                   ("request_put", 2, ".etcdserverpb.PutRequest", 0),
                   ("request_delete_range", 3, ".etcdserverpb.DeleteRangeRequest", 0)]),
    ("ResponseOp", [("response_range", 1, ".etcdserverpb.RangeResponse", 0),
                    ("response_put", 2, ".etcdserverpb.PutResponse", 0),
                    ("response_delete_range", 3, ".etcdserverpb.DeleteRangeResponse", 0)]),
    ("Compare", [("result", 1, "enum:.etcdserverpb.Compare.CompareResult"),
                 ("target", 2, "enum:.etcdserverpb.Compare.CompareTarget"), ("key", 3, "bytes"),
                 ("version", 4, "int64", 0), ("create_revision", 5, "int64", 0), ("mod_revision", 6, "int64", 0),
                 ("value", 7, "bytes", 0), ("lease", 8, "int64", 0), ("range_end", 64, "bytes")]),
    ("TxnRequest", [("compare", 1, "*.etcdserverpb.Compare"), ("success", 2, "*.etcdserverpb.RequestOp"),
                    ("failure", 3, "*.etcdserverpb.RequestOp")]),
    ("TxnResponse", [_H, ("succeeded", 2, "bool"), ("responses", 3, "*.etcdserverpb.ResponseOp")]),
    ("WatchRequest", [("create_request", 1, ".etcdserverpb.WatchCreateRequest", 0),
                      ("cancel_request", 2, ".etcdserverpb.WatchCancelRequest", 0),
                      ("progress_request", 3, ".etcdserverpb.WatchProgressRequest", 0)]),
    ("WatchCreateRequest", [("key", 1, "bytes"), ("range_end", 2, "bytes"), ("start_revision", 3, "int64"),
                            ("progress_notify", 4, "bool"), ("prev_kv", 6, "bool")]),
    ("WatchCancelRequest", [("watch_id", 1, "int64")]),
    ("WatchProgressRequest", []),
    ("WatchResponse", [_H, ("watch_id", 2, "int64"), ("created", 3, "bool"), ("canceled", 4, "bool"),
                       ("compact_revision", 5, "int64"), ("cancel_reason", 6, "string"),
                       ("events", 11, "*.mvccpb.Event")]),
    ("LeaseGrantRequest", [("TTL", 1, "int64"), ("ID", 2, "int64")]),
    ("LeaseGrantResponse", [_H, ("ID", 2, "int64"), ("TTL", 3, "int64"), ("error", 4, "string")]),
    ("LeaseRevokeRequest", [("ID", 1, "int64")]),
    ("LeaseRevokeResponse", [_H]),
    ("LeaseKeepAliveRequest", [("ID", 1, "int64")]),
    ("LeaseKeepAliveResponse", [_H, ("ID", 2, "int64"), ("TTL", 3, "int64")]),
    ("StatusRequest", []),
    ("StatusResponse", [_H, ("version", 2, "string"), ("dbSize", 3, "int64"), ("leader", 4, "uint64")]),
    ("AuthenticateRequest", [("name", 1, "string"), ("password", 2, "string")]),
    ("AuthenticateResponse", [_H, ("token", 2, "string")]),
]
_ENUMS = {
    "Event": [("EventType", ["PUT", "DELETE"])],
    "Compare": [("CompareResult", ["EQUAL", "GREATER", "LESS", "NOT_EQUAL"]),
                ("CompareTarget", ["VERSION", "CREATE", "MOD", "VALUE", "LEASE"])],
}
_ONEOFS = {"RequestOp": "request", "ResponseOp": "response", "Compare": "target_union",
           "WatchRequest": "request_union"}


def _file(name: str, package: str, messages: list, deps: list[str]) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto(name=name, package=package, syntax="proto3", dependency=deps)
    for msg_name, fields in messages:
        msg = proto.message_type.add(name=msg_name)
        for enum_name, values in _ENUMS.get(msg_name, ()):
            enum = msg.enum_type.add(name=enum_name)
            for number, value in enumerate(values):
                enum.value.add(name=value, number=number)
        if msg_name in _ONEOFS:
            msg.oneof_decl.add(name=_ONEOFS[msg_name])
        for spec in fields:
            fname, number, ftype = spec[:3]
            field = msg.field.add(name=fname, number=number, json_name=fname)
            field.label = _F.LABEL_REPEATED if ftype.startswith("*") else _F.LABEL_OPTIONAL
            ftype = ftype.lstrip("*")
            if ftype in _T:
                field.type = _T[ftype]
            elif ftype.startswith("enum:"):
                field.type, field.type_name = _F.TYPE_ENUM, ftype[5:]
            else:
                field.type, field.type_name = _F.TYPE_MESSAGE, ftype
            if len(spec) > 3:
                field.oneof_index = spec[3]
    return proto


# Private: this module's own pool. File names are cachefs-specific, so even a pool merge cannot clash.
POOL = descriptor_pool.DescriptorPool()
POOL.Add(_file("cachefs_etcd/kv.proto", "mvccpb", _KV, []))
POOL.Add(_file("cachefs_etcd/rpc.proto", "etcdserverpb", _RPC, ["cachefs_etcd/kv.proto"]))


def _cls(full_name: str) -> type:
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(full_name))


KeyValue = _cls("mvccpb.KeyValue")
Event = _cls("mvccpb.Event")
RangeRequest = _cls("etcdserverpb.RangeRequest")
RangeResponse = _cls("etcdserverpb.RangeResponse")
PutRequest = _cls("etcdserverpb.PutRequest")
PutResponse = _cls("etcdserverpb.PutResponse")
DeleteRangeRequest = _cls("etcdserverpb.DeleteRangeRequest")
DeleteRangeResponse = _cls("etcdserverpb.DeleteRangeResponse")
RequestOp = _cls("etcdserverpb.RequestOp")
Compare = _cls("etcdserverpb.Compare")
TxnRequest = _cls("etcdserverpb.TxnRequest")
TxnResponse = _cls("etcdserverpb.TxnResponse")
WatchRequest = _cls("etcdserverpb.WatchRequest")
WatchCreateRequest = _cls("etcdserverpb.WatchCreateRequest")
WatchResponse = _cls("etcdserverpb.WatchResponse")
LeaseGrantRequest = _cls("etcdserverpb.LeaseGrantRequest")
LeaseGrantResponse = _cls("etcdserverpb.LeaseGrantResponse")
LeaseRevokeRequest = _cls("etcdserverpb.LeaseRevokeRequest")
LeaseRevokeResponse = _cls("etcdserverpb.LeaseRevokeResponse")
LeaseKeepAliveRequest = _cls("etcdserverpb.LeaseKeepAliveRequest")
LeaseKeepAliveResponse = _cls("etcdserverpb.LeaseKeepAliveResponse")
StatusRequest = _cls("etcdserverpb.StatusRequest")
StatusResponse = _cls("etcdserverpb.StatusResponse")
AuthenticateRequest = _cls("etcdserverpb.AuthenticateRequest")
AuthenticateResponse = _cls("etcdserverpb.AuthenticateResponse")

EVENT_PUT, EVENT_DELETE = 0, 1
EQUAL, GREATER, LESS, NOT_EQUAL = 0, 1, 2, 3
TARGET_VERSION, TARGET_CREATE, TARGET_MOD, TARGET_VALUE, TARGET_LEASE = 0, 1, 2, 3, 4

# (service method path, request class, response class); streams are marked by the caller.
METHODS = {
    "Range": ("/etcdserverpb.KV/Range", RangeRequest, RangeResponse),
    "Put": ("/etcdserverpb.KV/Put", PutRequest, PutResponse),
    "DeleteRange": ("/etcdserverpb.KV/DeleteRange", DeleteRangeRequest, DeleteRangeResponse),
    "Txn": ("/etcdserverpb.KV/Txn", TxnRequest, TxnResponse),
    "Watch": ("/etcdserverpb.Watch/Watch", WatchRequest, WatchResponse),
    "LeaseGrant": ("/etcdserverpb.Lease/LeaseGrant", LeaseGrantRequest, LeaseGrantResponse),
    "LeaseRevoke": ("/etcdserverpb.Lease/LeaseRevoke", LeaseRevokeRequest, LeaseRevokeResponse),
    "LeaseKeepAlive": ("/etcdserverpb.Lease/LeaseKeepAlive", LeaseKeepAliveRequest, LeaseKeepAliveResponse),
    "Status": ("/etcdserverpb.Maintenance/Status", StatusRequest, StatusResponse),
    "Authenticate": ("/etcdserverpb.Auth/Authenticate", AuthenticateRequest, AuthenticateResponse),
}


def prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with ``prefix`` (etcd's convention)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"
