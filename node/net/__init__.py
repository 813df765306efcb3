"""The network: identity, DHT records and discovery, child processes, and the data-plane transports."""
