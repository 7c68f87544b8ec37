"""The quality study around the exact emulator: token streams, metrics, experiments."""
