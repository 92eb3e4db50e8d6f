"""Reading GGUF files (a target's, a written draft's): the reader, its fields, a model's summary
and its tokenizer keys, and the error that names a file llama.cpp cannot use."""

from __future__ import annotations

from pathlib import Path

from specforge_lite import SpecforgeError


class GGUFExportError(SpecforgeError, ValueError):
    """What llama.cpp cannot run, or a file that does not fit its target (exit 2)."""


TOKENIZER_PREFIX = "tokenizer."


def gguf_module():
    import gguf

    return gguf


# ---------------------------------------------------------------- reading a GGUF

# the last files read, by their state: an export reads its target GGUF for its summary, then for its
# tokenizer, and gguf's reader takes seconds over a vocabulary of tens of thousands of strings
_READ: dict[tuple, object] = {}
_READ_KEEP = 2


def read_gguf(path: Path):
    """A GGUFReader over `path`, or GGUFExportError naming the file (missing, truncated, not GGUF).
    The same file, unchanged since this process last read it, is not parsed again."""
    gguf = gguf_module()
    path = Path(path)
    if not path.is_file():
        raise GGUFExportError(f"{path}: no such GGUF file")
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key in _READ:
        return _READ[key]
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:  # the reader raises ValueError, struct errors, numpy errors...
        raise GGUFExportError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from None
    while len(_READ) >= _READ_KEEP:
        _READ.pop(next(iter(_READ)))
    _READ[key] = reader
    return reader


def field_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


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
