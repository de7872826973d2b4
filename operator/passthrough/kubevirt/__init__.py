"""KubeVirt as the consumer of what we produce: its host-device allow-list and feature gates.

`values` parses and checks the platform values, `allowlist` builds the permittedHostDevices
entries (the default table, the values', one per assigned device), `render` shapes them into
the KubeVirt CR's apply body, `mismatches` compares the allow-list with what nodes advertise,
and `commands` is `passthrough render`."""
