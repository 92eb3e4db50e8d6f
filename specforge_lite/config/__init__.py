"""The typed settings: the schema, its field rules and what the settings alone decide (how many
tokens each evaluate method drafts). No registry, no door: those sit above, in `drafters/` and
`stages/`.

Modules:
- `draft_tokens`: how many tokens each evaluate method drafts;
- `fields`: `checked`, a dataclass field with the rules the door checks;
- `schema`: the typed configuration schema.
"""

# the packages this one may import besides the ground (tests/unit/test_package_structure.py)
MAY_IMPORT = ()
