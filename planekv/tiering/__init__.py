"""planekv.tiering: block frame, tiers (GPU pool, host, NVMe via kvikio or POSIX, remote store),
placement policy engine, fetch with deadlines, promotion and prefetch. Builds on kvstore."""
