"""How each algorithm syncs a node with the swarm, one home each: gossip DiLoCo (`diloco/`), SPES
(`spes/`), and the outer step they share (`outer_group`)."""
