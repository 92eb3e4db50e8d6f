"""Running a target fast, for every stage that runs one (sampling, evaluation, training):
the static forward (`static_llama`), the compile helper and its settings (`compile`), the
graphs kept between runs (`graph_cache`), the engine and its chooser (`fast_engine`) and
Hugging Face's forward as a runner (`hf_runner`). Imports nothing else of the package
except `target.loading` (the model cache folder)."""
