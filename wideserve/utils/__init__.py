"""Process, thread, device-transfer and optional-dependency helpers."""
