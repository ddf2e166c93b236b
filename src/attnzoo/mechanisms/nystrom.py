"""nystrom (mechanisms): being built."""
