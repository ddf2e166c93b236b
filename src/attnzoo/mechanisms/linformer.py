"""linformer (mechanisms): being built."""
