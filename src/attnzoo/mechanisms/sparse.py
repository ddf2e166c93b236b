"""sparse: being built."""
