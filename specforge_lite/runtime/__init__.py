"""Running a target fast, for every stage that runs one (sampling, evaluation, training):
the static forward (`static_llama`), the compile helper and its settings (`compile`), the
graphs kept between runs (`graph_cache`), the engine and its chooser (`fast_engine`) and
Hugging Face's forward as a runner (`hf_runner`). Imports nothing else of the package
except `targets.loading` (the model cache folder).

Modules:
- `compile`: compiling a module's forward with inductor, and its settings;
- `compiled_run`: what a compiled evaluate builds before anything is timed;
- `drift`: whether the machine slowed down under a run;
- `dtype_choice`: which dtype a CPU target decodes in under `target.dtype=auto`;
- `fast_engine`: the static target forward, `FastEngine`;
- `graph_cache`: compiled graphs kept between runs;
- `hf_runner`: Hugging Face's own forward as a target runner;
- `machine`: what a results file says of the machine and the commit;
- `static_llama`: the static-cache forward of Llama-family targets;
- `target_choice`: which target forward a run decodes with;
- `target_package`: the target's forward as AOTInductor packages;
- `width_timing`: timing target forwards by width (the one routine), and when a timing may change a default.
"""

# the packages this one may import besides the ground (tests/unit/test_package_structure.py)
MAY_IMPORT = ('config', 'targets')
