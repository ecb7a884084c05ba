"""Flax decoder family (Llama / Qwen2 / Qwen3 / Mistral), KV cache, value and score heads."""
