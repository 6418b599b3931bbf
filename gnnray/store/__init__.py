"""The graph's place in Ray's object store, and the actors that serve it from other nodes (the shard servers)."""
