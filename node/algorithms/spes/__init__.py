"""SPES in the daemon: the node that freezes and syncs experts, its training loop and the DHT expert directory."""
