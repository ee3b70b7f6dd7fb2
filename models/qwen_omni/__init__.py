"""Qwen2.5-Omni as a voxring family: its talker (config.py, talker_layers.py, talker.py, loader.py,
tiny.py); the token-to-wave side lives beside it in its own files."""
