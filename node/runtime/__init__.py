"""The daemon, by job.

`serve` (start-up wiring, `run_node`, `run_bootstrap`), `host` (identity and p2pd), `data_plane` (the
gossip transport), `training` and `vector` (the two payloads), `status` (`NodeRuntime`, what the monitor
and `murmur status` read), `saving` (checkpoint, swarm average) and `shutdown`."""
