"""The decode role: an engine whose KV connector is the consumer: it loads the prefill
instance's KV for a prompt, then continues generation under its own continuous-batching
scheduler.

A role is data, not code: `engine/fleet.py` gives each role its `kv_transfer.kv_role` and ports,
and `splitserve decode --config FLEET.yaml --index N` (`cli.run_role`) serves it.
"""
