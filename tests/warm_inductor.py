"""Imported last by tests/forked_cli.py's fork server, after torch: fills inductor's per-process
caches once (tests/zygote.py: prewarm_inductor), so that no forked command fills them again."""

from tests.zygote import prewarm_inductor

prewarm_inductor()
