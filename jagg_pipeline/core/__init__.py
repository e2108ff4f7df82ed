"""The gradient core: SDE steps, the GRPO objective and JAGG, pure tensor functions."""
