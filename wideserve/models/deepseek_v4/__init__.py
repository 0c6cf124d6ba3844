"""DeepSeek-V4: config, model (with its MTP block), attention layer, checkpoint names."""
