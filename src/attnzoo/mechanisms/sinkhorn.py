"""sinkhorn (mechanisms): being built."""
