"""The target model: loading it and its tokenizer, its head alone, sharded over ranks, the bytes
each rank holds of it (`accounting`)."""

# the packages this one may import besides the ground (tests/unit/test_package_structure.py)
MAY_IMPORT = ('config',)
