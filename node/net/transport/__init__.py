"""Network implementations of `gossip.transport.Transport` (p2pd via hivemind, py-libp2p).

Deliberately imports nothing: the py-libp2p backend runs in a child process that must never import
hivemind (both register protobuf package `crypto.pb`), so importing this package must not pull either in.
"""
