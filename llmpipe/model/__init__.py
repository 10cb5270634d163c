"""The model's pieces plugged into llm-foundry: attention, the fused loss, and MFU."""
