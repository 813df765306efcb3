"""Training: the trainer and its loop in the daemon, checkpoints, data, models, the swarm recipe and rounds."""
