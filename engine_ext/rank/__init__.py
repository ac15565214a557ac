"""The rank side: what runs in a rank's process, beside the model (imports torch)."""
