"""The configuration: the typed schema, its field rules, validation at the door, the method catalogue, the drafter registry."""
