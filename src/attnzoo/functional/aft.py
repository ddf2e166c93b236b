"""aft (functional): being built."""
