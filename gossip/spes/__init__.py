"""SPES (sparse expert synchronisation for mixture-of-experts models) without torch: the rules
(`rules`: knobs, ownership, records), the merge warm-up (`merge`), the analytic traffic and memory
(`traffic`) and the fetch protocol for frozen copies (`fetch`).

`node/spes/node.py` runs these over a trainer and the gossip transport, and the daemon publishes the
records under `<swarm>.experts`. docs/spes.md explains the scheme.
"""

from gossip.spes.fetch import (
    EXPERT,
    FETCH,
    FETCH_PROTOCOL,
    REQUEST_LIMITS,
    ExpertFetch,
    ExpertHolder,
    FetchSkip,
    FetchStats,
    RefreshFailed,
)
from gossip.spes.merge import MERGE_NEIGHBOURS, expert_similarity, merge_layer, merge_partners
from gossip.spes.rules import (
    REFRESH_CODECS,
    ExpertHashMismatch,
    ExpertKey,
    ExpertRecord,
    Ownership,
    RecordsByPeer,
    SpesConfig,
    WireRecord,
    WireRecords,
    advance_record,
    assign_experts,
    codec_image,
    content_hash,
    expert_label,
    freshest_holder,
    merge_alpha,
    needs_refresh,
    parse_expert_label,
    records_from_wire,
    records_to_wire,
    refresh_source,
)
from gossip.spes.traffic import SyncTraffic, TrainingMemory, reference_sync_bytes, sync_bytes_sent, training_memory

__all__ = [
    "EXPERT",
    "FETCH",
    "FETCH_PROTOCOL",
    "MERGE_NEIGHBOURS",
    "REFRESH_CODECS",
    "REQUEST_LIMITS",
    "ExpertFetch",
    "ExpertHashMismatch",
    "ExpertHolder",
    "ExpertKey",
    "ExpertRecord",
    "FetchSkip",
    "FetchStats",
    "Ownership",
    "RecordsByPeer",
    "RefreshFailed",
    "SpesConfig",
    "SyncTraffic",
    "TrainingMemory",
    "WireRecord",
    "WireRecords",
    "advance_record",
    "assign_experts",
    "codec_image",
    "content_hash",
    "expert_label",
    "expert_similarity",
    "freshest_holder",
    "merge_alpha",
    "merge_layer",
    "merge_partners",
    "needs_refresh",
    "parse_expert_label",
    "records_from_wire",
    "records_to_wire",
    "reference_sync_bytes",
    "refresh_source",
    "sync_bytes_sent",
    "training_memory",
]
