"""Ray-free, engine-agnostic elastic-EP mechanisms. Torch is imported only by the modules
that handle tensors (workspace, graphs, comm, reshuffle)."""
