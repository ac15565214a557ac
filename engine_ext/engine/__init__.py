"""The reference elastic MoE engine: runs wherever torch runs (CPU with gloo, GPU with CUDA graphs)."""
