"""The engine: request intake, the step loop, outputs and streams, beam search."""
