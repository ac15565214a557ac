"""The reference MoE model: its layers, its seeded checkpoint, and the dense oracle that checks it."""
