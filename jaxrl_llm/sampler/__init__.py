"""Jitted prefill + KV-cache decode on the policy's own (sharded) parameters."""
