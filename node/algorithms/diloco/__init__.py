"""Gossip DiLoCo in the daemon: the inner/outer trainer and its place in the swarm's loop."""
