"""The target model: loading it and its tokenizer, its head alone, sharded over ranks, generating with it."""
