"""One module per rule or small group of related rules; importing a module registers its rules."""
