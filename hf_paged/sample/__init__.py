"""Token selection: the sampler, penalties, logprobs, per-request logits processors."""
