"""Running a target fast, for every stage that runs one (sampling, evaluation, training):
the static forward (`static_llama`), the compile helper and its settings (`compile`), the
graphs kept between runs (`graph_cache`), the engine and its chooser (`fast_engine`) and
Hugging Face's forward as a runner (`hf_runner`). Imports nothing else of the package
except `targets.loading` (the model cache folder)."""

# the packages this one may import besides the ground (tests/unit/test_package_structure.py)
MAY_IMPORT = ('config', 'targets')
