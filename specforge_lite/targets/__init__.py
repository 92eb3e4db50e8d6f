"""The target model: loading it and its tokenizer (`loading`, `model_types`, `folder`), its head
alone (`head`), sharded over ranks (`sharded`), the bytes each rank holds of it (`accounting`),
the content digest of its weights (`digest`), and draft models cut from it (`surgery`)."""

# the packages this one may import besides the ground (tests/unit/test_package_structure.py)
MAY_IMPORT = ('config',)
