"""The embedded toy world: a small, real text-to-image problem built on a CPU in minutes."""
