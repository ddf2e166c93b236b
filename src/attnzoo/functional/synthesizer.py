"""synthesizer (functional): being built."""
