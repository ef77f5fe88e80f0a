"""NIXL connector: pull KV blocks with one-sided READs (UCX), host or device memory."""
