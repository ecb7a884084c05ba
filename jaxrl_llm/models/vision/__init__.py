"""Vision towers of vision-language policies (docs/vision.md): Qwen2.5-VL's ViT (`qwen_vit`)."""
