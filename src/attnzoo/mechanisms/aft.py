"""aft (mechanisms): being built."""
