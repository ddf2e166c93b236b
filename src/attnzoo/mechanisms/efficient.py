"""efficient (mechanisms): being built."""
