"""specforge_lite: train speculative-decoding drafters for your own target model.

Modules:
- `__main__`: the command line, `python -m specforge_lite STAGE [overrides]`;
- `checked_io`: opening artifact files so that a missing or damaged one is named, not a library error;
- `config/`: the typed settings, their field rules, what the settings alone decide;
- `contract`: what every drafter provides (the `Drafter` and `DrafterModule` interfaces);
- `data/`: conversation sources, evaluation prompt sets, chat templating, the samples dataset;
- `decoding/`: speculative decoding at batch 1: proposers, the verifier, the loop, the policy and cost model;
- `drafters/`: the trainable drafters, one folder each, and the catalogue of evaluation methods;
- `measurement/`: what an evaluate measures of decoding and how its report says it;
- `records/`: results files, the docs made from them, the GPU check;
- `run_folders`: run directories and their provenance;
- `runtime/`: running a target fast: static forward, compiled graphs, dtype and engine choices;
- `scale/`: launching ranks, sizing, dry runs, rehearsals of the GPU cards;
- `serving/`: vLLM and llama.cpp in the loop;
- `stage_table`: the stages in one table (name, module, folder, help);
- `stages/`: the stages (sample, train, evaluate, export) and the door;
- `targets/`: the target model: loading, its head, sharding, accounting, digests, surgery;
- `training/`: what the train stage is built from: features, losses, optimisers, checkpoints, strategies.
"""

__version__ = "0.1.0"


class SpecforgeError(Exception):
    """An error the user can fix (bad input, missing package, bad config).

    The CLI prints its message without a traceback and exits with status 2.
    """
