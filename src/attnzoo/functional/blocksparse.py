"""blocksparse: being built."""
