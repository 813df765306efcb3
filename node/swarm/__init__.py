"""What the peers agree on and how they stay together: the swarm's recipe (the `<swarm>.config`
schema), rounds, the training loop, progress, joining and the swarm's evaluation."""
