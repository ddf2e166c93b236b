"""efficient (functional): being built."""
