"""The node agent: discovery, NodePCIDevice reporting, hotplug."""
