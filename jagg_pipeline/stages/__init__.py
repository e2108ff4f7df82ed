"""The stages of a round (rollout, score, train, evaluate) and what they share: policy, FSDP."""
