"""Training: pretraining and finetuning through llm-foundry, checkpoints, LoRA, FP8, FSDP, throughput, tracking."""
