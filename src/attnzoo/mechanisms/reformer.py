"""reformer: being built."""
