"""linformer (functional): being built."""
