"""sinkhorn (functional): being built."""
