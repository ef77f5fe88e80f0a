"""NCCL/gloo connector: two-sided sends over a process group per producer-consumer pair."""
