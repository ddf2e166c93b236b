"""fnet (mechanisms): being built."""
