"""The prefill role: an engine whose KV connector is the producer: it computes a
prompt's KV and first token, then holds the blocks under a lease until a decode instance pulls
them.

A role is data, not code: `engine/fleet.py` gives each role its `kv_transfer.kv_role` and ports,
and `splitserve prefill --config FLEET.yaml --index N` (`cli.run_role`) serves it.
"""
