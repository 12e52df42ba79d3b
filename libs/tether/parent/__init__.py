"""The parent service: commands, the concurrency cap, RPC, and the fast-path deliveries."""
