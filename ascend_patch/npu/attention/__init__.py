"""The Ascend attention backends."""
