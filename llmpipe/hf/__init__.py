"""Hugging Face format: export of a composer checkpoint."""
