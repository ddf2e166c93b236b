"""clustered: being built."""
