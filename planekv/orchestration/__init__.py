"""planekv.orchestration: Ray workers and actors, the embedded local cluster, Ray job entrypoints.
Builds on every other component."""
