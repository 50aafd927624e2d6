"""Debug helpers that ship with remotorch: example models, the demo, a malformed-message generator."""
