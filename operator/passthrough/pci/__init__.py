"""PCI devices: discovery from sysfs (eligibility rules), the pci.ids database, names from IDs."""
