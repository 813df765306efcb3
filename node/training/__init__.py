"""Training: the trainer and its loop in the daemon, the settings it takes, checkpoints, data, models,
the swarm recipe and rounds."""
