"""synthesizer (mechanisms): being built."""
