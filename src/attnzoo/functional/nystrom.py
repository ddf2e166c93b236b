"""nystrom (functional): being built."""
