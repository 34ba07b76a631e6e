"""Models: what a stage loads and where it lives.

Base models (a tiny model built from a seed, a local checkpoint, a hub id), a frozen reference and a
sequence scorer (``loading``), the PPO critic (``critic``), GGUF
and hub checkpoints converted once (``pretrained``), LoRA adapters (``lora``) and the devices of a
stage's frozen models (``placement``). It may import ``stages.spec_model`` only; everything that
samples, scores or trains imports it.
"""
