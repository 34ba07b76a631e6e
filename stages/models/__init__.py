"""Models: what a stage loads and where it lives: base models, the frozen reference and
sequence scorers (``loading``), the PPO critic, converted checkpoints (``pretrained``), LoRA and
device placement. It may import ``stages.spec_model`` only."""
