"""Models: what a stage loads (base models, the reference, the critic, converted checkpoints, LoRA) and where it
lives. It may import ``stages.spec_model`` only."""
