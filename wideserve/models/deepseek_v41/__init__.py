"""DeepSeek-V4.1: config, model, attention layer, DSpark draft stages, what they share."""
