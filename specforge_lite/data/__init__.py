"""Conversation sources, validation, splitting and chat templating.

Modules:
- `chat`: chat templating with an assistant-only loss mask;
- `eval_prompts`: evaluation prompt sets (MT-Bench, ShareGPT task areas, a file, the held-out split);
- `formats`: what each `data.format` names, and the refusal of a source not of it;
- `readers`: readers of conversation sources;
- `samples`: the samples dataset the sample stage writes and train reads.
"""

# the packages this one may import besides the ground (tests/unit/test_package_structure.py)
MAY_IMPORT = ('config', 'targets', 'runtime')
