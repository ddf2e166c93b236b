"""lsh: being built."""
