"""Reading GGUF files (a target's, a written draft's): the reader, its fields, a model's summary
and its tokenizer keys, and the error that names a file llama.cpp cannot use."""

from __future__ import annotations

import functools
from pathlib import Path

from specforge_lite import SpecforgeError
from specforge_lite.checked_io import file_stamp


class GGUFExportError(SpecforgeError, ValueError):
    """What llama.cpp cannot run, or a file that does not fit its target (exit 2)."""


TOKENIZER_PREFIX = "tokenizer."


def gguf_module():
    import gguf

    return gguf


# ---------------------------------------------------------------- reading a GGUF

def read_gguf(path: Path):
    """A GGUFReader over `path`, or GGUFExportError naming the file (missing, truncated, not GGUF).
    The same file, unchanged since this process last read it, is not parsed again (an export reads
    its target's GGUF for its summary, then for its tokenizer: seconds each over a large vocabulary)."""
    path = Path(path)
    if not path.is_file():
        raise GGUFExportError(f"{path}: no such GGUF file")
    try:
        return _reader(file_stamp(path.resolve()))
    except Exception as err:  # the reader raises ValueError, struct errors, numpy errors...
        raise GGUFExportError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from None


@functools.lru_cache(maxsize=2)
def _reader(stamp: tuple):
    return gguf_module().GGUFReader(stamp[0])


def field_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_summary(path: Path) -> dict:
    """architecture, layer count, hidden size and vocabulary size of a GGUF model file."""
    reader = read_gguf(path)
    arch = field_value(reader, "general.architecture")
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    if arch is None or tokens is None:
        raise GGUFExportError(f"{path}: GGUF without general.architecture or a tokenizer vocabulary")
    return {"architecture": arch, "block_count": field_value(reader, f"{arch}.block_count"),
            "embedding_length": field_value(reader, f"{arch}.embedding_length"), "vocab_size": len(tokens)}


def copy_tokenizer(reader, writer) -> None:
    """Every `tokenizer.*` key of `reader` (vocabulary, merges, special ids, chat template)."""
    gguf = gguf_module()
    for name, field in reader.fields.items():
        if not name.startswith(TOKENIZER_PREFIX):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
