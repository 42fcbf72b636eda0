"""Prompt-state reuse: the prefix index, state specs per layer kind, and the arena that holds the state."""
