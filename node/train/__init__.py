"""What one node computes, with no network: the trainer, the models, the data and its shards, the
tokenizer, checkpoints and exports, and the settings training takes from the node's config."""
