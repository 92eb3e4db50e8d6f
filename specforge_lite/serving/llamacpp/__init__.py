"""llama.cpp in the loop: GGUF exports of our drafters and llama.cpp as an evaluation backend.

Modules:
- `checks`: what llama.cpp can run, checked at the door;
- `dflash_gguf`: our DFlash export as a GGUF of llama.cpp's `dflash` architecture;
- `files`: the GGUF files of one run and `export/gguf/`;
- `gguf_export`: GGUF files written from our Hugging Face-format exports;
- `gguf_read`: reading GGUF files and naming one llama.cpp cannot use;
- `methods`: the `llamacpp_*` evaluate methods;
- `report`: llama.cpp as an evaluate engine and its report section;
- `runner`: llama.cpp in-process through `xllamacpp`.
"""
