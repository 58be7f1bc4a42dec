"""One rank running one step: the engine's actions, its stages and their states, messages, and the step's clock."""
