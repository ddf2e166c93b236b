"""fnet (functional): being built."""
