"""The operator: device lifecycle (assignment, conditions, garbage collection) and KubeVirt configuration."""
