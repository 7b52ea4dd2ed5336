"""Training tools that drive the engine (``hf-paged train-eagle``): they sit with the commands, above the engine."""
