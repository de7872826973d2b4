"""KubeVirt as the consumer of what we produce: its host-device allow-list and feature gates,
rendered from the platform values (`render`) and printed by `passthrough render` (`commands`)."""
