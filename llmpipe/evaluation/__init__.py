"""Evaluation: in-context-learning suites and their data, token counts, lm-evaluation-harness, generation."""
